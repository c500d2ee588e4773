"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with deferred weight gradients.

FSDP2 reduce-scatters a module's gradients in its post-backward hook, which runs as soon as the
module's part of the autograd backward is over. A splitgrad layer built with
``delay_wgrad_compute=True`` has not computed its weight gradient by then: it lands later, in
``backward_dw()``, in the *unsharded* parameter's ``.grad``, which FSDP has already given up on.
Without help that gradient is silently lost.

:func:`fully_shard` is torch's, plus this: while deferred work is owed to a parameter group's
parameters, the group's post-backward only reshards (``backward_dw`` reads the stashed input and
grad-output, never the weight, so the unsharded weights can be freed) and keeps every unsharded
gradient; the reduce-scatter is started by the grad-ready hook of the group's last delayed
parameter, i.e. right after the last ``backward_dw()`` that contributes to the group, so it
overlaps with the ``backward_dw()`` calls of the other groups still to come. Before the optimizer
reads the sharded gradients, :func:`finish_fsdp_reductions` waits for those reductions (an
optimizer step calls it by itself).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C
from ._deferred import _param_aliases, register_grad_ready_hook
from ._grouped_linear import GroupedLinear
from ._linear import _DeferredWgradModule

__all__ = ["fully_shard", "finish_fsdp_reductions", "fsdp_reduction_log"]

_lock = threading.Lock()
# Every splitgrad-managed FSDP group, and those whose reduce-scatter backward_dw() started and
# nobody has waited for yet.
_groups: "weakref.WeakSet[_DeferredGroup]" = weakref.WeakSet()
_in_flight: "weakref.WeakSet[_DeferredGroup]" = weakref.WeakSet()
# The groups whose reduce-scatter the backward held back, in launch order: the reverse of the order
# fully_shard() made them (bottom-up: the root, holding the output layer whose backward_dw()
# usually runs first, then the last block, ...), the same on every rank. They start in that order,
# whatever order each rank's backward_dw() calls complete them in: collectives issued in a
# rank-dependent order would pair one rank's group with another's (a wrong sum, or gloo's
# size-mismatch abort).
_held: "list[_DeferredGroup]" = []
_launching = threading.RLock()  # one thread starts held reductions at a time, in queue order
_made = itertools.count()
#: One entry per reduce-scatter a splitgrad-managed FSDP group started: (the group's delayed layers,
#: when), ``when`` being "backward" (nothing deferred was owed: FSDP's usual place) or
#: "backward_dw" (started right after the last deferred contribution landed). Tests and users read
#: it to see when the collectives ran; clear it freely.
fsdp_reduction_log: list[tuple[str, str]] = []


def _into_accumulated_grad(fsdp_param) -> None:
    """The unsharded .grad into FSDP's accumulated gradient (reduce dtype), added to one there
    already or becoming it; nothing without a mixed-precision reduce dtype."""
    fsdp_param.accumulate_unsharded_grad_if_needed()
    fsdp_param.to_accumulated_grad_if_needed()


class _DeferredGroup:
    """The deferral state of one FSDP parameter group."""

    def __init__(self, module: nn.Module) -> None:
        self.group = module._get_fsdp_state()._fsdp_param_group
        self.original_post_backward = self.group.post_backward
        # FSDPParams of delayed splitgrad layers (their unsharded parameters exist only after the
        # first all-gather, so the hooks are registered at the first forward).
        self.delayed = [p for p in self.group.fsdp_params if _delayed_layer(p) is not None]
        self.layers = ", ".join(dict.fromkeys(_delayed_layer(p).name for p in self.delayed)) or "-"
        self.handles = []
        self.deferred = False  # FSDP's post-backward was held back for deferred work
        self.drops_seen = 0  # deferred items dropped for this group's parameters, at the last reduction
        self.launch_rank = -next(_made)  # place in _held: made later, launched earlier
        self.group.post_backward = self.post_backward
        if self.delayed:
            module.register_forward_pre_hook(self._register_hooks_once)
        _groups.add(self)

    def _unsharded(self) -> list[torch.Tensor]:
        return [p._unsharded_param for p in self.delayed
                if hasattr(p, "_unsharded_param") and p._unsharded_param.requires_grad]

    def _register_hooks_once(self, module, args) -> None:
        if self.handles:
            return
        # FSDP's own pre-forward hook, registered first, has all-gathered the parameters.
        self.handles = [register_grad_ready_hook(p, self._ready) for p in self._unsharded()]

    def owed(self) -> bool:
        """Deferred contributions to this group's parameters are still to land."""
        return any(_C.pending_wgrads_for(p) for p in self._unsharded())

    def _drops(self) -> int:
        return sum(_C.dropped_wgrads_for(p) for p in self._unsharded())

    def post_backward(self, *unused: Any) -> None:
        """FSDP's post-backward; while gradients sync and deferred work is owed, everything but the
        reduction (backward_dw() reads the stashed input and grad-output, not the weights)."""
        if self.group.reduce_grads and self.owed():
            self.group._training_state = TrainingState.POST_BACKWARD
            for fsdp_param in self.group.fsdp_params:
                fsdp_param.accumulate_unsharded_grad_if_needed()
            if self.group.reshard_after_backward:
                self.group.reshard()
            self.deferred = True
            with _lock:
                if self not in _held:  # still held from a step whose work is pending: once
                    bisect.insort(_held, self, key=lambda g: g.launch_rank)
            return
        reduces = self.group.reduce_grads and self._has_unsharded_grads()
        self.original_post_backward(*unused)
        if reduces:
            fsdp_reduction_log.append((self.layers, "backward"))

    def _has_unsharded_grads(self) -> bool:
        return any(hasattr(p, "_unsharded_param")
                   and (p._unsharded_param.grad is not None or p.unsharded_accumulated_grad is not None)
                   for p in self.group.fsdp_params)

    def _ready(self, param: torch.Tensor) -> None:
        # A pass's deferred contributions to `param` have all landed. Under a mixed-precision
        # policy whose reduce dtype is wider (bf16 compute, fp32 reduction) they go into the
        # accumulated gradient now, as FSDP's post-backward moves each pass's autograd gradient
        # there: micro-batches add up in the reduce dtype, not in a bf16 .grad.
        for fsdp_param in self.delayed:
            if getattr(fsdp_param, "_unsharded_param", None) is param:
                _into_accumulated_grad(fsdp_param)
        _launch_held()

    def complete(self) -> bool:
        """Held back, and nothing deferred is owed any more. A contribution dropped since the last
        reduction leaves the gradient incomplete: finish_fsdp_reductions() reports that instead of
        reducing a partial sum."""
        return self.deferred and not self.owed() and self._drops() == self.drops_seen

    def reduce_deferred(self) -> None:
        """Starts the held-back reduce-scatter of every unsharded gradient of the group."""
        self.deferred = False
        self.drops_seen = self._drops()
        # FSDP reduce-scatters the group's gradients in one dtype: where some are accumulated
        # already (in the reduce dtype), the others (this pass's .grads) join them there.
        params = [p for p in self.group.fsdp_params if hasattr(p, "_unsharded_param")]
        if any(p.unsharded_accumulated_grad is not None for p in params):
            for fsdp_param in params:
                _into_accumulated_grad(fsdp_param)
        previous = self.group._training_state
        try:
            self.original_post_backward()
        finally:
            self.group._training_state = previous
        fsdp_reduction_log.append((self.layers, "backward_dw"))
        with _lock:
            _in_flight.add(self)

    def discard_unsharded_grads(self) -> None:
        with _lock:
            if self in _held:
                _held.remove(self)
        self.deferred = False
        self.drops_seen = self._drops()
        for fsdp_param in self.group.fsdp_params:
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None
            fsdp_param.unsharded_accumulated_grad = None

    def wait(self) -> None:
        self.group._wait_for_post_backward()
        comm = self.group.comm_ctx
        if comm.reduce_scatter_state is not None and comm.reduce_scatter_state.event is not None:
            self.group.device_handle.current_stream().wait_event(comm.reduce_scatter_state.event)
        comm.reduce_scatter_state = None


def _launch_held() -> None:
    """Starts the held-back reductions at the head of the queue that can start."""
    with _launching:
        while True:
            with _lock:
                if not _held or not _held[0].complete():
                    return
                group = _held.pop(0)
            group.reduce_deferred()


def _unsharded_aliases(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The unsharded parameters of those of ``params`` that are FSDP's sharded ones: the deferred
    work is queued on them, so the pending-work checks of optimizer.step()/zero_grad() and
    state_dict() (which see the sharded ones) look there too."""
    ids = {id(p) for p in params}
    return [fsdp_param._unsharded_param for group in list(_groups) for fsdp_param in group.group.fsdp_params
            if id(fsdp_param.sharded_param) in ids and hasattr(fsdp_param, "_unsharded_param")]


_param_aliases.append(_unsharded_aliases)


def _delayed_layer(fsdp_param) -> _DeferredWgradModule | GroupedLinear | None:
    info = fsdp_param._module_info
    for module in (info.module, *info.shared_modules):
        if isinstance(module, (_DeferredWgradModule, GroupedLinear)) and module.delay_wgrad_compute:
            return module
    return None


def _step_pre_hook(optimizer, args, kwargs) -> None:
    finish_fsdp_reductions()


_step_hook_installed = False


def _gloo_only_default_group() -> bool:
    return dist.is_initialized() and dist.get_backend() == dist.Backend.GLOO


def fully_shard(module: nn.Module | list[nn.Module], **kwargs):
    """``torch.distributed.fsdp.fully_shard(module, **kwargs)`` for modules with delayed splitgrad
    layers: a parameter group that is owed deferred wgrad work reduce-scatters after the last
    ``backward_dw()`` contributing to it instead of in its post-backward hook (see the module
    docstring). Apply it as torch's, bottom-up (each block, then the root); it returns torch's FSDP
    module. Everything else is FSDP2's own: ``reshard_after_forward``, mixed precision,
    ``set_requires_gradient_sync(False)`` for gradient accumulation (nothing is reduced then; the
    micro-batch that syncs reduces everything accumulated, deferred parts included).

    ``fuse_wgrad_accumulation`` (``main_grad``) is refused: under FSDP the gradients live in FSDP's
    buffers.

    Without a ``mesh``, the default process group's backend picks its device: a gloo-only group
    gets a CPU mesh over all ranks (torch's default would be the accelerator's, whichever backend
    the group has, and fail on a machine with fewer GPUs than ranks); others get torch's default.
    """
    global _step_hook_installed
    for m in module if isinstance(module, list) else [module]:
        for layer in m.modules():
            if isinstance(layer, (_DeferredWgradModule, GroupedLinear)) and layer.fuse_wgrad_accumulation:
                raise ValueError(
                    f"splitgrad.distributed.fully_shard: layer '{layer.name}' has "
                    "fuse_wgrad_accumulation=True; under FSDP the gradients live in FSDP's buffers, "
                    "so build it with fuse_wgrad_accumulation=False")
    if kwargs.get("mesh") is None and _gloo_only_default_group():
        kwargs["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = _torch_fully_shard(module, **kwargs)
    state_owner = sharded[0] if isinstance(sharded, list) else sharded
    if state_owner._get_fsdp_state()._fsdp_param_group is not None:
        _DeferredGroup(state_owner)
    if not _step_hook_installed:
        register_optimizer_step_pre_hook(_step_pre_hook)
        _step_hook_installed = True
    return sharded


def finish_fsdp_reductions() -> None:
    """Make the current stream wait for the reduce-scatters that ``backward_dw()`` started, so the
    sharded gradients can be read (an optimizer step calls this itself).

    A unit whose reduction was held back and can no longer start — its deferred work is no longer
    owed but did not all land, because an item was dropped (a stashed tensor modified in place) —
    raises a RuntimeError naming its layers after the other units are waited for; its unsharded
    gradients are discarded, so no partial gradient is reduced now or mixed into the next step.
    The decision is this rank's: ranks that did reduce the unit wait for this one's reduce-scatter.
    A unit whose deferred work is still pending stays held back (it reduces when the work lands).
    """
    stranded = [g for g in list(_groups) if g.deferred and not g.owed() and not g.complete()]
    for group in stranded:
        group.discard_unsharded_grads()
    _launch_held()  # those the stranded ones held up
    with _lock:
        groups = list(_in_flight)
        _in_flight.clear()
    for group in groups:
        group.wait()
    if stranded:
        raise RuntimeError(
            "splitgrad.distributed.fully_shard: the gradients of the FSDP unit(s) of layer(s) "
            f"{'; '.join(repr(g.layers) for g in stranded)} were not reduced: part of their deferred "
            "wgrad work was dropped (see the error raised by backward_dw()), so their gradients are "
            "incomplete. Their unsharded gradients were discarded; run the step again where every "
            "rank dropped alike (a rank that reduced these units waits for this one's reduce-scatter "
            "until the process group's timeout).")
