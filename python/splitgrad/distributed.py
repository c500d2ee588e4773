"""Data-parallel gradient reduction driven by splitgrad's grad-ready hooks.

:class:`GradReducer` is a DDP-style reducer: it groups a model's parameters into buckets and
launches one asynchronous ``torch.distributed.all_reduce`` per bucket as soon as every parameter of
the bucket is *ready* — that is, when ``splitgrad.register_grad_ready_hook`` reports that the last
contribution of the backward pass (immediate or deferred, from any layer it is tied to) has landed.
The collectives therefore overlap with the ``backward_dw()`` calls still to come, and a tied
weight is reduced once, with its whole gradient. :meth:`GradReducer.finish` waits for them and
writes the reduced gradients back.

Only ``mode="all_reduce"`` is implemented so far; ``"reduce_scatter"`` (ZeRO-2/FSDP-style sharded
gradients) is a later step.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ._deferred import register_grad_ready_hook

__all__ = ["GradReducer"]

_MODES = ("all_reduce",)


def _gradient_source(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient lives: ``main_grad`` (fuse_wgrad_accumulation / Megatron) if the
    parameter has one, else ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class _Bucket:
    __slots__ = ("index", "params", "names", "offsets", "numel", "dtype", "device", "buffer",
                 "ready", "work")

    def __init__(self, index: int, dtype: torch.dtype, device: torch.device) -> None:
        self.index = index
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.offsets: list[int] = []
        self.numel = 0
        self.dtype = dtype
        self.device = device
        self.buffer: torch.Tensor | None = None  # allocated at the first launch
        self.ready = 0  # parameters of this bucket ready in the current step
        self.work = None  # the in-flight all_reduce of the current step

    def add(self, param: torch.Tensor, name: str) -> None:
        self.params.append(param)
        self.names.append(name)
        self.offsets.append(self.numel)
        self.numel += param.numel()


class GradReducer:
    """Averages (or sums) a model's gradients over a process group, bucket by bucket, each bucket
    launched as soon as all of its parameters are ready.

    Args:
        model: the module whose parameters to reduce. Each parameter is reduced once, however many
            layers it is tied to; parameters with ``requires_grad=False`` are left alone.
        process_group: the ``torch.distributed`` group (default: the world group).
        bucket_cap_mb: the most megabytes of gradient per bucket (a larger parameter gets a bucket
            of its own). Buckets are filled in reverse registration order, as DDP does.
        mode: ``"all_reduce"`` (DDP-style). ``"reduce_scatter"`` is not implemented yet.
        average: divide the sum by the group's size (the default), else leave the sum.

    The gradient of a parameter is its ``main_grad`` if it has that attribute (set it before
    building the reducer, so the bucket gets its dtype), else its ``.grad``.

    One step::

        reducer = GradReducer(model)
        loss = model(x).sum(); loss.backward()
        for layer in reversed(delayed_layers):   # the all-reduces start during these calls
            layer.backward_dw()
        reducer.finish()                          # wait; .grad / main_grad now hold the average
        optimizer.step()

    Every parameter must become ready exactly once between two ``finish()`` calls (outside
    :meth:`no_sync`); ``finish()`` raises a ``RuntimeError`` naming the parameters that did not, and a
    parameter made ready twice raises at once. All ranks must make the parameters ready in the same
    order (run the same schedule), since the buckets are launched in the order they become ready.
    """

    def __init__(self, model: nn.Module, process_group=None, bucket_cap_mb: float = 25,
                 mode: str = "all_reduce", average: bool = True) -> None:
        if mode == "reduce_scatter":
            raise NotImplementedError("GradReducer: mode='reduce_scatter' is not implemented yet; use 'all_reduce'")
        if mode not in _MODES:
            raise ValueError(f"GradReducer: expected mode 'all_reduce', got {mode!r}")
        if not (isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
                and bucket_cap_mb > 0):
            raise ValueError(f"GradReducer: expected a positive bucket_cap_mb, got {bucket_cap_mb!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("GradReducer: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group() first")
        self.model = model
        self.process_group = process_group
        self.mode = mode
        self.average = bool(average)
        self.world_size = dist.get_world_size(process_group)
        #: (bucket_index, tuple of parameter names), one entry per all_reduce launched, in launch order.
        self.launch_log: list[tuple[int, tuple[str, ...]]] = []

        params: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            params.append((name, param))
        if not params:
            raise ValueError("GradReducer: the model has no parameter that requires grad")

        cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, slot in bucket)
        for name, param in reversed(params):
            source = getattr(param, "main_grad", None)
            dtype = source.dtype if source is not None else param.dtype
            itemsize = torch.empty((), dtype=dtype).element_size()
            bucket = self._buckets[-1] if self._buckets else None
            if (bucket is None or bucket.dtype != dtype or bucket.device != param.device
                    or (bucket.numel + param.numel()) * itemsize > cap_bytes):
                bucket = _Bucket(len(self._buckets), dtype, param.device)
                self._buckets.append(bucket)
            self._where[id(param)] = (bucket.index, len(bucket.params))
            bucket.add(param, name)
        self._names = {id(param): name for name, param in params}  # in registration order

        self._lock = threading.Lock()
        self._sync = True
        self._ready: set[int] = set()  # ids of the parameters ready in the current step
        self._handles = [register_grad_ready_hook(param, self._hook) for _, param in params]

    # -- introspection --------------------------------------------------------------------------

    @property
    def buckets(self) -> list[tuple[str, ...]]:
        """The parameter names of each bucket, in bucket order."""
        return [tuple(b.names) for b in self._buckets]

    # -- the grad-ready hook --------------------------------------------------------------------

    def _hook(self, param: torch.Tensor) -> None:
        with self._lock:
            if not self._sync:
                return  # no_sync(): the gradient accumulates locally; nothing is counted
            key = id(param)
            name = self._names[key]
            if key in self._ready:
                raise RuntimeError(
                    f"GradReducer: parameter '{name}' became ready twice before finish() (two backward "
                    "passes reduced in one step?). Run the earlier micro-batches' backward and "
                    "backward_dw() inside reducer.no_sync(), or call finish() after each step."
                )
            self._ready.add(key)
            bucket = self._buckets[self._where[key][0]]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        for param, name, offset in zip(bucket.params, bucket.names, bucket.offsets):
            grad = _gradient_source(param)
            if grad is None:
                raise RuntimeError(f"GradReducer: parameter '{name}' became ready without a gradient "
                                   "(.grad and main_grad are both None)")
            bucket.buffer[offset:offset + param.numel()].copy_(grad.reshape(-1))
        if self.average and self.world_size > 1:
            bucket.buffer.div_(self.world_size)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        self.launch_log.append((bucket.index, tuple(bucket.names)))

    # -- the step ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for every launched all_reduce and write the reduced gradients back into each
        parameter's ``.grad`` / ``main_grad``; then start a new step.

        Raises RuntimeError naming the parameters that did not become ready in this step (the
        buckets that were launched are still waited for and written back first)."""
        with self._lock:
            if not self._sync:
                raise RuntimeError("GradReducer.finish() called inside no_sync(): nothing is reduced "
                                   "there; call finish() after the step that leaves no_sync()")
            try:
                for bucket in self._buckets:
                    if bucket.work is None:
                        continue
                    bucket.work.wait()
                    for param, offset in zip(bucket.params, bucket.offsets):
                        grad = _gradient_source(param)
                        grad.copy_(bucket.buffer[offset:offset + param.numel()].view_as(grad))
                missing = [name for key, name in self._names.items() if key not in self._ready]
            finally:
                self._reset()
            if missing:
                raise RuntimeError(
                    f"GradReducer.finish(): {len(missing)} parameter(s) never became ready in this step, "
                    f"so their gradients were not reduced: {', '.join(repr(n) for n in missing)}. "
                    "Were they unused in the forward pass, or is their backward_dw() still pending?"
                )

    def _reset(self) -> None:
        self._ready.clear()
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.work = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, grad-ready events are ignored and nothing is reduced (the
        gradients accumulate locally). Run the backward *and* the backward_dw() of those
        micro-batches inside; the step after it, outside, reduces the accumulated gradients."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def remove(self) -> None:
        """Unregister the grad-ready hooks (launched all_reduces are not waited for: call finish() first)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
