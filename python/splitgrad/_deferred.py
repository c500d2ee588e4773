"""The process-wide deferred-wgrad API, and the checks that no deferred work is forgotten."""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C
from ._errors import ArgumentError, PendingWgradError, PendingWgradWarning

__all__ = [
    "backward_dw_all",
    "pending_wgrads",
    "layers_with_pending_wgrads",
    "register_grad_ready_hook",
    "set_pending_work_policy",
    "get_pending_work_policy",
]


def backward_dw_all(params: Iterable[torch.Tensor] | None = None) -> None:
    """Run every pending deferred wgrad in the process, oldest first; with ``params`` (one model's,
    ``model.parameters()``), only the work that feeds them, so that threads training models of their
    own run only their own work. Returns once that work has landed, including items another thread
    had already taken."""
    if params is None:
        _C.backward_dw_all()
        return
    params = list(params)
    if params:  # an empty list would mean "all" to the C++ call
        _C.backward_dw_all(params)


def pending_wgrads() -> int:
    """How many deferred wgrad items are waiting (all layers)."""
    return _C.pending_wgrads()


def layers_with_pending_wgrads(params: Iterable[torch.Tensor] | None = None) -> list[str]:
    """Names of the layers with pending deferred work (only work feeding ``params``, if given)."""
    return _C.layers_with_pending_wgrads(list(params) if params is not None else [])


class _HookStore:
    """A parameter's grad-ready hooks, kept on the parameter's Python object (``param.__dict__``) so
    that the garbage collector sees them: a hook whose closure refers to the model no longer keeps
    the model alive (the C++ side holds only a key). Copies and pickles of the parameter get an
    empty store: hooks belong to the parameter they were registered on."""

    def __init__(self) -> None:
        self.hooks: dict[int, Callable[[torch.Tensor], None]] = {}

    def __reduce__(self):
        return (_HookStore, ())

    def __deepcopy__(self, memo):
        return _HookStore()


_STORE_ATTR = "_splitgrad_grad_ready_hooks"
_hook_keys = itertools.count(1)


def _run_grad_ready_hook(key: int, param: torch.Tensor) -> None:
    store = param.__dict__.get(_STORE_ATTR)
    fn = store.hooks.get(key) if store is not None else None
    if fn is not None:
        fn(param)


class GradReadyHookHandle:
    """Returned by :func:`register_grad_ready_hook`; ``remove()`` unregisters the hook."""

    def __init__(self, param: torch.Tensor, key: int, handle) -> None:
        self._param = weakref.ref(param)
        self._key = key
        self._handle = handle

    @property
    def active(self) -> bool:
        return self._handle.active

    def remove(self) -> None:
        self._handle.remove()
        param = self._param()
        store = param.__dict__.get(_STORE_ATTR) if param is not None else None
        if store is not None:
            store.hooks.pop(self._key, None)
            if not store.hooks:
                del param.__dict__[_STORE_ATTR]


def register_grad_ready_hook(param: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> GradReadyHookHandle:
    """Call ``fn(param)`` exactly once per backward pass that adds to ``param.grad`` (or its
    ``main_grad``), after the last contribution to ``param`` of that pass has landed (immediate or
    deferred, from any layer or ordinary autograd op). Passes that write no gradient
    (``torch.autograd.grad``) do not call it, as with ``register_post_accumulate_grad_hook``.

    The hook is kept on ``param`` itself: it does not keep ``param``'s module alive. Returns a
    handle whose ``remove()`` unregisters the hook.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"register_grad_ready_hook: expected a torch.Tensor parameter, got {type(param).__name__}")
    if not callable(fn):
        raise TypeError(f"register_grad_ready_hook: expected a callable hook, got {type(fn).__name__}")
    if not (param.is_leaf and param.requires_grad):
        raise ArgumentError(
            "register_grad_ready_hook: expected a leaf tensor that requires grad (a parameter), got one "
            f"with is_leaf={param.is_leaf}, requires_grad={param.requires_grad}"
        )
    key = next(_hook_keys)
    store = param.__dict__.get(_STORE_ATTR)
    if store is None:
        store = param.__dict__[_STORE_ATTR] = _HookStore()
    store.hooks[key] = fn
    # The C++ side holds only this module-level function and the key, never fn.
    return GradReadyHookHandle(param, key, _C.register_grad_ready_hook(param, functools.partial(_run_grad_ready_hook, key)))


def grad_ready_pass() -> int | None:
    """Inside a grad-ready hook: the id of the backward pass whose gradient it reports complete
    (the ids ``layer._layer.pending_passes()`` lists); ``None`` elsewhere. A hook watching several
    parameters tells with it which of their events belong to one pass."""
    return _C.grad_ready_pass()


_POLICIES = ("warn", "error")
_policy = "warn"


def set_pending_work_policy(policy: str) -> None:
    """What ``optimizer.zero_grad()``, ``optimizer.step()``, ``module.zero_grad()`` and
    ``state_dict()`` do when deferred wgrad work is pending: ``"warn"`` (a PendingWgradWarning;
    the work stays queued) or ``"error"`` (a PendingWgradError; nothing is changed)."""
    global _policy
    if policy not in _POLICIES:
        raise ValueError(f"set_pending_work_policy: expected one of {_POLICIES}, got {policy!r}")
    _policy = policy


def get_pending_work_policy() -> str:
    return _policy


# Functions mapping parameters to other tensors their deferred work may be queued on: FSDP2 queues
# it on the unsharded parameters while optimizers and modules hold the sharded ones (_fsdp adds one).
_param_aliases: list[Callable[[list[torch.Tensor]], list[torch.Tensor]]] = []


def check_no_pending(action: str, params: Iterable[torch.Tensor] | None = None) -> None:
    """Warn or raise (per the policy) if deferred work feeding ``params`` (or any) is pending."""
    if _C.pending_wgrads() == 0:
        return
    if params is not None:
        params = list(params)
        params += [alias for aliases in _param_aliases for alias in aliases(params)]
    layers = layers_with_pending_wgrads(params)
    if not layers:
        return
    message = (
        f"{action} while deferred wgrad work is pending for layer(s) {', '.join(repr(n) for n in layers)}: "
        "their weight gradients have not been computed yet. Call backward_dw() on those layers "
        "(or splitgrad.backward_dw_all()) first."
    )
    if _policy == "error":
        raise PendingWgradError(message)
    warnings.warn(message, PendingWgradWarning, stacklevel=3)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _install_guards() -> None:
    """Make optimizer.step()/zero_grad()/state_dict(), Module.zero_grad(), gradient clipping and
    GradScaler.unscale_() report pending deferred work."""

    def step_pre_hook(optimizer, args, kwargs):
        check_no_pending(f"{type(optimizer).__name__}.step()", _optimizer_params(optimizer))

    register_optimizer_step_pre_hook(step_pre_hook)

    # zero_grad has no hook in PyTorch: wrap it (behaviour unchanged when nothing is pending).
    optimizer_zero_grad = torch.optim.Optimizer.zero_grad

    @functools.wraps(optimizer_zero_grad)
    def guarded_optimizer_zero_grad(self, *args, **kwargs):
        if _C.pending_wgrads():
            check_no_pending(f"{type(self).__name__}.zero_grad()", _optimizer_params(self))
        return optimizer_zero_grad(self, *args, **kwargs)

    module_zero_grad = torch.nn.Module.zero_grad

    @functools.wraps(module_zero_grad)
    def guarded_module_zero_grad(self, *args, **kwargs):
        if _C.pending_wgrads():
            check_no_pending(f"{type(self).__name__}.zero_grad()", list(self.parameters()))
        return module_zero_grad(self, *args, **kwargs)

    optimizer_state_dict = torch.optim.Optimizer.state_dict

    @functools.wraps(optimizer_state_dict)
    def guarded_optimizer_state_dict(self, *args, **kwargs):
        # a checkpoint taken mid-step, as Module.state_dict() reports it
        if _C.pending_wgrads():
            check_no_pending(f"{type(self).__name__}.state_dict()", _optimizer_params(self))
        return optimizer_state_dict(self, *args, **kwargs)

    torch.optim.Optimizer.zero_grad = guarded_optimizer_zero_grad
    torch.optim.Optimizer.state_dict = guarded_optimizer_state_dict
    torch.nn.Module.zero_grad = guarded_module_zero_grad

    # Clipping reads the gradients as they are: before backward_dw() it clips partial gradients,
    # and the deferred parts land unclipped afterwards. (A name imported from torch before splitgrad
    # keeps the unguarded function.)
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
        clip = getattr(torch.nn.utils, name, None)
        if clip is None:
            continue

        @functools.wraps(clip)
        def guarded_clip(*args, _clip=clip, _name=name, **kwargs):
            if _C.pending_wgrads():
                params = kwargs["parameters"] if "parameters" in kwargs else args[0]
                params = [params] if isinstance(params, torch.Tensor) else list(params)
                if "parameters" in kwargs:
                    kwargs["parameters"] = params
                else:
                    args = (params, *args[1:])
                check_no_pending(f"torch.nn.utils.{_name}()", params)
            return _clip(*args, **kwargs)

        setattr(torch.nn.utils, name, guarded_clip)
        if hasattr(torch.nn.utils.clip_grad, name):
            setattr(torch.nn.utils.clip_grad, name, guarded_clip)

    # AMP's unscale_ (explicit before clipping, or inside GradScaler.step()) divides the gradients
    # as they are: deferred parts landing afterwards would stay scaled, and step() would no longer
    # find them pending.
    scalers = [torch.amp.GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scalers.append(ShardedGradScaler)
    except ImportError:  # a PyTorch built without torch.distributed
        pass
    for scaler in scalers:
        unscale = scaler.__dict__.get("unscale_")
        if unscale is None:
            continue

        @functools.wraps(unscale)
        def guarded_unscale(self, optimizer, *args, _unscale=unscale, **kwargs):
            if _C.pending_wgrads():
                check_no_pending(f"{type(self).__name__}.unscale_()", _optimizer_params(optimizer))
            return _unscale(self, optimizer, *args, **kwargs)

        scaler.unscale_ = guarded_unscale


_install_guards()
