"""Data-parallel gradient reduction driven by splitgrad's grad-ready hooks.

:class:`GradReducer` groups a model's parameters into buckets and launches one asynchronous
collective per bucket as soon as every parameter of the bucket is *ready* — that is, when
``splitgrad.register_grad_ready_hook`` reports that the last contribution of the backward pass
(immediate or deferred, from any layer it is tied to) has landed. The collectives therefore overlap
with the ``backward_dw()`` calls still to come, and a tied weight is reduced once, with its whole
gradient. :meth:`GradReducer.finish` waits for them.

Buckets are launched in bucket order, as DDP does: a bucket whose parameters are ready waits for
the buckets before it, so the order in which parameters become ready (a schedule's W order, which
may differ from rank to rank) never decides which buffers are summed.

- ``mode="all_reduce"`` (DDP-style): ``torch.distributed.all_reduce`` per bucket; ``finish()`` writes
  the reduced gradients back into ``.grad`` / ``main_grad``.
- ``mode="reduce_scatter"`` (ZeRO-2/FSDP-style): ``torch.distributed.reduce_scatter_tensor`` per
  bucket into this rank's shard of it; after ``finish()``, :meth:`GradReducer.sharded_grad` and
  :meth:`GradReducer.shard_range` give each parameter's reduced slice that this rank owns. The full
  ``.grad`` / ``main_grad`` keeps the local (unreduced) gradient.

:func:`fully_shard` is FSDP2's ``torch.distributed.fsdp.fully_shard`` for models with delayed
splitgrad layers: a parameter group owed deferred wgrad work reduce-scatters after the last
``backward_dw()`` that contributes to it, instead of in FSDP's post-backward hook (where those
gradients do not exist yet and would be lost).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import _C
from ._deferred import register_grad_ready_hook
from ._fsdp import finish_fsdp_reductions, fsdp_reduction_log, fully_shard

__all__ = ["GradReducer", "fully_shard", "finish_fsdp_reductions", "fsdp_reduction_log"]

_MODES = ("all_reduce", "reduce_scatter")
# Every live GradReducer (a pipeline stage hands them the division of the gradients they reduce).
_live_reducers: "weakref.WeakSet[GradReducer]" = weakref.WeakSet()


def _call_if_alive(method: weakref.WeakMethod, *args):
    bound = method()
    return bound(*args) if bound is not None else None


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _gradient_source(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient lives: ``main_grad`` (fuse_wgrad_accumulation / Megatron) if the
    parameter has one, else ``.grad``. A ``.grad`` beside a ``main_grad`` (what autograd gave a
    parameter no fused GEMM writes: a norm's weight, an ordinary op's use of a tied weight) is
    added into ``main_grad`` and cleared first, as Megatron's gradient hook does."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        return param.grad
    if param.grad is not None:
        with torch.no_grad():
            main_grad.add_(param.grad)
        param.grad = None
    return main_grad


class _Bucket:
    __slots__ = ("index", "params", "names", "offsets", "numel", "dtype", "device", "buffer",
                 "ready", "work", "shard", "reduced")

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
        self.work = None  # the in-flight collective of the current step
        # reduce_scatter mode: this rank's shard of the (padded) reduced buffer, and whether it
        # holds the result of the last finish()
        self.shard: torch.Tensor | None = None
        self.reduced = False

    def add(self, param: torch.Tensor, name: str) -> None:
        self.params.append(param)
        self.names.append(name)
        self.offsets.append(self.numel)
        self.numel += param.numel()

    def padded_numel(self, world_size: int) -> int:
        """The buffer's length in reduce_scatter mode: numel rounded up to a multiple of world_size."""
        return -(-self.numel // world_size) * world_size


def _divide_after_reduction(params, divisor: int) -> set[int]:
    """A pipeline stage's ``scale_grads()``: the GradReducers with a step under way that reduce
    some of ``params`` divide those parameters' reduced gradients by ``divisor`` in ``finish()``.
    A division of the local gradients now would be undone by ``finish()``'s write-back of the
    sums taken when the parameters became ready (or, for a bucket launched later on some rank,
    mix divided and undivided gradients across the ranks). Returns the ids of those parameters:
    the caller divides only the others."""
    taken: set[int] = set()
    for reducer in list(_live_reducers):
        taken |= reducer._divide_after_reduction(params, divisor)
    return taken


class GradReducer:
    """Averages (or sums) a model's gradients over a process group, bucket by bucket, each bucket
    launched as soon as all of its parameters are ready; all-reduced (every rank gets the whole
    result) or reduce-scattered (every rank gets its shard).

    Args:
        model: the module whose parameters to reduce. Each parameter is reduced once, however many
            layers it is tied to; parameters with ``requires_grad=False`` are left alone.
        process_group: the ``torch.distributed`` group (default: the world group).
        bucket_cap_mb: the most megabytes of gradient per bucket (a larger parameter gets a bucket
            of its own). Buckets are filled in reverse registration order, as DDP does.
        mode: ``"all_reduce"`` (DDP-style: the reduced gradients are written back into ``.grad`` /
            ``main_grad``) or ``"reduce_scatter"`` (ZeRO-2/FSDP-style: each bucket's flat gradient,
            padded to a multiple of the group size, is reduce-scattered; rank ``r`` owns the ``r``-th
            of the group-size equal shards. Read the result with :meth:`sharded_grad` /
            :meth:`shard_range` after ``finish()``, or the whole shards in :attr:`shards`; ``.grad``
            / ``main_grad`` are left holding the local, unreduced gradient).
        average: divide the sum by the group's size (the default), else leave the sum.
        passes_per_step: the backward passes (micro-batches) of one step, each of which fires a
            parameter's grad-ready hook once (default 1). With ``n``, a parameter is ready at its
            ``n``-th hook since the last ``finish()``: what a pipeline schedule's stage needs, whose
            micro-batches' B and W run interleaved inside ``schedule.step()`` (where ``no_sync()``
            cannot be placed around all but the last).
        find_unused_parameters: DDP's option. A parameter that has not become ready by ``finish()``
            and has no deferred work pending counts as ready with its current gradient (zeros if it
            has none); a parameter used on no rank keeps its gradient untouched (``.grad`` stays
            ``None``; in reduce_scatter mode :meth:`sharded_grad` raises for it). Without it
            (the default) such a parameter is an error (see below).

    The gradient of a parameter is its ``main_grad`` if it has that attribute (set it before
    building the reducer, so the bucket gets its dtype), else its ``.grad``. A ``.grad`` that a
    parameter with a ``main_grad`` also holds (a norm's weight in a fused LayerNormLinear, a use
    outside splitgrad's GEMMs) is added into the ``main_grad`` and cleared, as Megatron does.

    One step::

        reducer = GradReducer(model)
        loss = model(x).sum(); loss.backward()
        for layer in reversed(delayed_layers):   # the all-reduces start during these calls
            layer.backward_dw()
        reducer.finish()                          # wait; .grad / main_grad now hold the average
        optimizer.step()

    In ``mode="reduce_scatter"`` the step is the same, then for each parameter
    ``reducer.sharded_grad(p)`` is the reduced ``p.grad.flatten()[start:stop]`` with
    ``(start, stop) = reducer.shard_range(p)`` (empty where this rank owns none of ``p``).

    Buckets are launched in bucket order (reverse registration order), whatever order the parameters
    become ready in, so the ranks may run their ``backward_dw()`` calls in different orders; the
    collectives overlap best when the last layers' work runs first. That order holds per reducer:
    several reducers on one process group launch in the order their buckets become ready, so their
    ranks must complete the reducers' work in one order, or each reducer needs a group of its own
    (``dist.new_group(ranks)``).

    Every parameter must become ready exactly once between two ``finish()`` calls (outside
    :meth:`no_sync`), unless ``find_unused_parameters=True``; a parameter made ready twice raises at
    once. ``finish()`` launches the buckets still waiting (a parameter not ready contributes its
    current gradient, or zeros), then a small all-reduce of which parameters were ready on how many
    ranks, so every rank takes the same decision and no collective is left in flight: a bucket with a
    parameter that was not ready on some rank (without ``find_unused_parameters``) or still owed
    deferred work on some rank (always) is not written back, and ``finish()`` raises a
    ``RuntimeError`` on every rank naming every parameter left unreduced. A ``finish()`` with no step
    since the previous one (no forward with grad enabled through ``model``, no parameter ready) does
    nothing.
    """

    def __init__(self, model: nn.Module, process_group=None, bucket_cap_mb: float = 25,
                 mode: str = "all_reduce", average: bool = True,
                 find_unused_parameters: bool = False, passes_per_step: int = 1) -> None:
        if mode not in _MODES:
            raise ValueError(f"GradReducer: expected mode 'all_reduce' or 'reduce_scatter', got {mode!r}")
        if not (isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
                and bucket_cap_mb > 0):
            raise ValueError(f"GradReducer: expected a positive bucket_cap_mb, got {bucket_cap_mb!r}")
        if not isinstance(passes_per_step, int) or isinstance(passes_per_step, bool) or passes_per_step < 1:
            raise ValueError(f"GradReducer: expected a positive int passes_per_step, got {passes_per_step!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("GradReducer: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group() first")
        self.model = model
        self.process_group = process_group
        self.mode = mode
        self.average = bool(average)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.passes_per_step = passes_per_step
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        #: (bucket_index, tuple of parameter names), one entry per collective launched, in launch order.
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
        if mode == "reduce_scatter":
            for bucket in self._buckets:
                bucket.shard = torch.zeros(bucket.padded_numel(self.world_size) // self.world_size,
                                           dtype=bucket.dtype, device=bucket.device)

        self._params = {id(param): param for _, param in params}  # in registration order
        self._lock = threading.Lock()
        self._sync = True
        self._ready: set[int] = set()  # ids of the parameters ready in the current step
        self._passes: dict[int, int] = {}  # id(param) -> its grad-ready hooks in the current step
        self._next = 0  # the next bucket to launch: buckets go in bucket order, as in DDP
        self._used_map: torch.Tensor | None = None  # per parameter: ranks it was ready on, ranks owing work
        self._used_work = None
        self._active = False  # a step began since the last finish()
        self._unused: set[int] = set()  # ids of the parameters used on no rank in the last step
        # id(param) -> what finish() divides its reduced gradient by (a pipeline stage's scale_grads)
        self._divisors: dict[int, int] = {}
        _live_reducers.add(self)
        # The hooks live on the parameters and the model: they hold the reducer weakly, so a reducer
        # dropped without remove() stops reducing (and is freed) instead of launching collectives
        # beside its successor's; its hooks are removed when it is collected.
        hook, forward_pre_hook = weakref.WeakMethod(self._hook), weakref.WeakMethod(self._forward_pre_hook)
        self._handles = [register_grad_ready_hook(param, functools.partial(_call_if_alive, hook))
                         for _, param in params]
        self._handles.append(model.register_forward_pre_hook(functools.partial(_call_if_alive, forward_pre_hook)))
        weakref.finalize(self, _remove_handles, self._handles)

    # -- introspection --------------------------------------------------------------------------

    @property
    def buckets(self) -> list[tuple[str, ...]]:
        """The parameter names of each bucket, in bucket order."""
        return [tuple(b.names) for b in self._buckets]

    @property
    def shards(self) -> list[torch.Tensor]:
        """reduce_scatter mode: this rank's shard buffer of each bucket, in bucket order (the buffers
        are reused from step to step; their contents are valid after ``finish()``)."""
        self._require_sharded("shards")
        return [b.shard for b in self._buckets]

    def _require_sharded(self, what: str) -> None:
        if self.mode != "reduce_scatter":
            raise RuntimeError(f"GradReducer.{what} is only available with mode='reduce_scatter' "
                               f"(this reducer's mode is {self.mode!r})")

    def _slot(self, param: torch.Tensor) -> tuple[_Bucket, int, int, int]:
        """(bucket, the parameter's offset in the bucket, start, stop) with start/stop as in
        :meth:`shard_range`."""
        where = self._where.get(id(param))
        if where is None:
            raise ValueError("GradReducer: the tensor is not one of the parameters this reducer reduces")
        bucket = self._buckets[where[0]]
        offset = bucket.offsets[where[1]]
        numel = param.numel()
        shard_numel = bucket.shard.numel()
        shard_begin = self.rank * shard_numel  # this rank's shard within the bucket's flat buffer
        start = min(max(shard_begin - offset, 0), numel)
        stop = max(start, min(shard_begin + shard_numel - offset, numel))
        return bucket, offset, start, stop

    def shard_range(self, param: torch.Tensor) -> tuple[int, int]:
        """reduce_scatter mode: the indices ``(start, stop)`` into ``param.flatten()`` whose reduced
        gradient this rank holds (``start == stop`` where it holds none). Over the ranks in order,
        the ranges tile ``[0, param.numel())``."""
        self._require_sharded("shard_range()")
        _, _, start, stop = self._slot(param)
        return start, stop

    def sharded_grad(self, param: torch.Tensor) -> torch.Tensor:
        """reduce_scatter mode, after ``finish()``: this rank's slice of ``param``'s reduced (averaged
        or summed) gradient, flattened — a 1-D view into the bucket's shard buffer covering
        ``param.flatten()[start:stop]`` with ``(start, stop) = shard_range(param)``; empty where this
        rank owns none of ``param``. Raises if the parameter's bucket was not reduced in the last
        ``finish()``."""
        self._require_sharded("sharded_grad()")
        bucket, offset, start, stop = self._slot(param)
        if id(param) in self._unused:
            raise RuntimeError(
                f"GradReducer.sharded_grad(): '{self._names[id(param)]}' was used on no rank in the last "
                "step (find_unused_parameters=True); it has no reduced gradient")
        if not bucket.reduced:
            raise RuntimeError(
                f"GradReducer.sharded_grad(): the bucket of '{self._names[id(param)]}' was not reduced "
                "in the last step (call finish() after the step; was the parameter never ready?)")
        return self._sharded_slice(param)

    # -- the grad-ready hook --------------------------------------------------------------------

    def _forward_pre_hook(self, module, args) -> None:
        if self._sync and torch.is_grad_enabled():
            self._active = True

    def _hook(self, param: torch.Tensor) -> None:
        with self._lock:
            if not self._sync:
                return  # no_sync(): the gradient accumulates locally; nothing is counted
            key = id(param)
            name = self._names[key]
            self._active = True
            passes = self._passes[key] = self._passes.get(key, 0) + 1
            if passes < self.passes_per_step:
                return  # an earlier micro-batch's gradient: it accumulates locally
            if key in self._ready:
                raise RuntimeError(
                    f"GradReducer: parameter '{name}' became ready "
                    f"{'twice' if passes == 2 else f'{passes} times'} before finish(), for "
                    f"passes_per_step={self.passes_per_step} (more backward passes reduced in one "
                    "step?). Run the earlier micro-batches' backward and backward_dw() inside "
                    "reducer.no_sync() or give passes_per_step the micro-batches per step, and call "
                    "finish() after each step."
                )
            self._ready.add(key)
            self._buckets[self._where[key][0]].ready += 1
            # in bucket order: a ready bucket waits for those before it
            while self._next < len(self._buckets) and \
                    self._buckets[self._next].ready == len(self._buckets[self._next].params):
                self._launch(self._buckets[self._next])
            if self._next == len(self._buckets) and self._used_work is None and not _capturing():
                self._launch_used_map()

    def _launch(self, bucket: _Bucket) -> None:
        sharded = self.mode == "reduce_scatter"
        if bucket.buffer is None:
            size = bucket.padded_numel(self.world_size) if sharded else bucket.numel
            bucket.buffer = torch.empty(size, dtype=bucket.dtype, device=bucket.device)
        for param, name, offset in zip(bucket.params, bucket.names, bucket.offsets):
            grad = _gradient_source(param)
            piece = bucket.buffer[offset:offset + param.numel()]
            if grad is not None:
                piece.copy_(grad.reshape(-1))
            elif id(param) not in self._ready:
                piece.zero_()  # launched by finish(): not ready here, contributes nothing
            else:
                raise RuntimeError(f"GradReducer: parameter '{name}' became ready without a gradient "
                                   "(.grad and main_grad are both None)")
        if sharded:
            bucket.reduced = False  # the shard is being overwritten until finish()
            bucket.buffer[bucket.numel:].zero_()  # the padding (a backend may have written to it)
            bucket.work = dist.reduce_scatter_tensor(bucket.shard, bucket.buffer, op=dist.ReduceOp.SUM,
                                                     group=self.process_group, async_op=True)
        else:
            if self.average and self.world_size > 1:
                bucket.buffer.div_(self.world_size)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        self._next += 1
        self.launch_log.append((bucket.index, tuple(bucket.names)))

    def _launch_used_map(self) -> None:
        """After the last bucket: sums over the ranks, per parameter, whether it was ready and whether
        deferred work is still owed to it, so that finish() decides alike on every rank."""
        n = len(self._names)
        local = torch.zeros(2 * n, dtype=torch.int32)
        for i, (key, param) in enumerate(self._params.items()):
            if key in self._ready:
                local[i] = 1
            elif _C.pending_wgrads_for(param):
                local[n + i] = 1
        self._used_map = local.to(self._buckets[0].device)
        self._used_work = dist.all_reduce(self._used_map, group=self.process_group, async_op=True)

    # -- the step ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Launch the buckets still waiting, wait for every collective; in all_reduce mode write the
        reduced gradients back into each parameter's ``.grad`` / ``main_grad``, in reduce_scatter mode
        leave them in the shards (:meth:`sharded_grad`); then start a new step. Collective: every
        rank calls it once per step (a second call with no step between does nothing).

        Raises RuntimeError, on every rank alike, naming every parameter left unreduced: the
        parameters of each bucket with a parameter that some rank did not make ready (without
        ``find_unused_parameters``) or still owes deferred work to; the other buckets are written
        back first."""
        with self._lock:
            if not self._sync:
                raise RuntimeError("GradReducer.finish() called inside no_sync(): nothing is reduced "
                                   "there; call finish() after the step that leaves no_sync()")
            if not self._active:
                return  # no step since the last finish(): its results stand
            try:
                while self._next < len(self._buckets):
                    self._launch(self._buckets[self._next])
                keys = list(self._names)
                if _capturing():
                    used, owing = self._local_decision(keys)
                else:
                    if self._used_work is None:
                        self._launch_used_map()
                    self._used_work.wait()
                    n = len(self._names)
                    counts = self._used_map.cpu().tolist()
                    used = {key: counts[i] for i, key in enumerate(keys)}
                    owing = {key for i, key in enumerate(keys) if counts[n + i]}
                not_ready = {key for key in keys if used[key] < self.world_size}
                bad = owing | (set() if self.find_unused_parameters else not_ready)
                self._unused = ({key for key in keys if used[key] == 0 and key not in owing}
                                if self.find_unused_parameters else set())
                left: list[_Bucket] = []
                for bucket in self._buckets:
                    bucket.reduced = False
                for bucket in self._buckets:
                    bucket.work.wait()
                    if any(id(p) in bad for p in bucket.params):
                        left.append(bucket)
                        self._divide_local(bucket)
                        continue
                    if self.mode == "reduce_scatter":
                        if self.average and self.world_size > 1:
                            bucket.shard.div_(self.world_size)
                        bucket.reduced = True
                        self._divide_local(bucket)
                        for param in bucket.params:
                            if id(param) in self._divisors and id(param) not in self._unused:
                                self._sharded_slice(param).div_(self._divisors[id(param)])
                        continue
                    for param, offset in zip(bucket.params, bucket.offsets):
                        if id(param) in self._unused:
                            self._divide_local(bucket, param)
                            continue  # used on no rank: its gradient stays as it is, as in DDP
                        reduced = bucket.buffer[offset:offset + param.numel()].view_as(param)
                        grad = _gradient_source(param)
                        if grad is None:  # unused on this rank only
                            grad = param.grad = reduced.clone()
                        else:
                            grad.copy_(reduced)
                        if id(param) in self._divisors:
                            grad.div_(self._divisors[id(param)])
                message = self._unreduced_message(left, used, owing, bad) if left else None
            finally:
                self._reset()
            if message:
                raise RuntimeError(message)

    def _divide_after_reduction(self, params, divisor: int) -> set[int]:
        """See the module's _divide_after_reduction(): the ids of ``params`` this reducer takes."""
        with self._lock:
            if not (self._sync and self._active):
                return set()  # no step under way: the local gradients are the result
            taken = {id(p) for p in params if id(p) in self._params}
            for key in taken:
                self._divisors[key] = self._divisors.get(key, 1) * divisor
            return taken

    def _divide_local(self, bucket: "_Bucket", only: torch.Tensor | None = None) -> None:
        """A stage's division handed to finish(), applied to the local gradients of ``bucket``'s
        parameters (or of ``only``) that no write-back replaces: reduce_scatter mode, parameters
        used on no rank, buckets left unreduced."""
        for param in bucket.params if only is None else [only]:
            grad = _gradient_source(param)
            if id(param) in self._divisors and grad is not None:
                grad.div_(self._divisors[id(param)])

    def _sharded_slice(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``param``'s reduced gradient in its bucket's shard (maybe empty)."""
        bucket, offset, start, stop = self._slot(param)
        if start == stop:
            return bucket.shard[:0]
        begin = offset + start - self.rank * bucket.shard.numel()
        return bucket.shard[begin:begin + stop - start]

    def _local_decision(self, keys: list) -> tuple[dict, set]:
        """Under CUDA-graph capture no host synchronisation is allowed, so the ranks' readiness cannot
        be exchanged: a captured step must make every parameter ready on this rank (what a replayed
        step does on every rank alike); anything else is refused here, at capture."""
        missing = [self._names[key] for key in keys if key not in self._ready]
        if missing:
            raise RuntimeError(
                f"GradReducer.finish() under CUDA-graph capture: {len(missing)} parameter(s) did not become "
                f"ready in the captured step ({', '.join(repr(n) for n in missing)}); a captured step "
                "cannot exchange readiness between ranks (that needs a host synchronisation), so every "
                "parameter must be used and its backward_dw() run inside the captured step.")
        return {key: self.world_size for key in keys}, set()

    def _unreduced_message(self, left: list[_Bucket], used: dict, owing: set, bad: set) -> str:
        left_ids = {id(p) for bucket in left for p in bucket.params}
        names = [name for key, name in self._names.items() if key in left_ids]
        causes = [f"'{self._names[key]}' on {self.world_size - used[key]} of {self.world_size} rank(s)"
                  f"{' (this one among them)' if key not in self._ready else ''}"
                  for key in self._names if key in bad]
        pending = [self._names[key] for key in self._names if key in owing]
        message = (f"GradReducer.finish(): {len(names)} parameter(s) were not reduced in this step on any "
                   f"rank (their gradients are left local): {', '.join(repr(n) for n in names)}. Not "
                   f"ready: {', '.join(causes)}")
        message += "; the others share a bucket with those." if len(names) > len(causes) else "."
        if pending:
            message += (f" Deferred work is still pending for {', '.join(repr(n) for n in pending)}: run "
                        "those layers' backward_dw() before finish() (to recover: run it inside "
                        "reducer.no_sync(), zero the gradients and redo the step).")
        if len(pending) < len(causes):
            message += (" A parameter unused in the forward pass? Build the GradReducer with "
                        "find_unused_parameters=True to reduce such parameters as zero contributions.")
        return message

    def _reset(self) -> None:
        self._ready.clear()
        self._passes.clear()
        self._next = 0
        self._used_map = None
        self._used_work = None
        self._active = False
        self._divisors.clear()
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
        """Unregister the grad-ready hooks (launched collectives are not waited for: call finish() first)."""
        _live_reducers.discard(self)  # a pipeline stage's scaling no longer waits for its finish()
        _remove_handles(self._handles)
