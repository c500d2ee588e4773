"""splitgrad.Linear: a drop-in for transformer_engine.pytorch.Linear's delayed-wgrad API."""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import pickle
import threading
import warnings
import weakref
from typing import Callable

import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor, peek_interpreter_stack
from torch.nn.parallel import DistributedDataParallel

from . import _C
from ._deferred import check_no_pending, grad_ready_pass, register_grad_ready_hook
from ._errors import ArgumentError, DTypeError, MainGradError, PendingWgradWarning

__all__ = ["Linear", "name_layers"]


# te.Linear keywords whose default means "the feature is off", which splitgrad accepts at that value.
# (The tensor-parallel ones are taken by _take_tensor_parallel_keywords first.)
_TE_DEFAULTS = {
    "ub_overlap_rs": False,
    "ub_overlap_ag": False,
    "ub_name": None,
}
# te.Linear's (TE 2.x) on top of those.
_TE_LINEAR_DEFAULTS = {
    **_TE_DEFAULTS,
    "parameters_split": None,
    "ub_overlap_rs_dgrad": False,
    "ub_bulk_dgrad": False,
    "ub_bulk_wgrad": False,
    "symmetric_ar_type": None,
    "save_original_input": False,
}


def _default_device() -> torch.device:
    """device=None: the device of a ``with torch.device(...)`` block or ``torch.set_default_device``
    where one is set (as nn.Linear honours them: meta-device init), else CUDA when available, else
    the CPU."""
    if _device_context_set():
        return torch.get_default_device()
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _device_context_set() -> bool:
    # How torch.get_default_device finds one (it reports "cpu" for none as for an explicit CPU).
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    if any(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack()):
        return True
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None) is not None


_linear_op = torch.ops.splitgrad.linear.default


def _autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled for any device (it raises for one without autocast, e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _exporting() -> bool:
    # torch.compiler.is_exporting() is constant-folded to True by Dynamo under torch.compile too;
    # the flag it reads is set by torch.export only.
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def _differentiated_functionally(*tensors: torch.Tensor | None) -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, jvp, vmap, ...) is running, or forward-mode
    AD carries a tangent on one of ``tensors``: PyTorch runs no C++ autograd Function there, and
    the gradients are returned, not accumulated, so there is nothing to defer or fuse."""
    if torch.compiler.is_compiling():
        # Dynamo misreads the functorch interpreter stack outside transforms: compiled code takes
        # the op (README: torch.compile of a transform over a splitgrad layer is not supported).
        return False
    if peek_interpreter_stack() is not None:
        return True
    if forward_ad._current_level < 0:  # the common case: no dual level
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _base_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func's wrappers."""
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


@torch.compiler.disable(
    reason="a splitgrad.Linear with delay_wgrad_compute or fuse_wgrad_accumulation runs eagerly "
    "(a graph break): its deferred work and main_grad accumulation happen outside compiled graphs, "
    "so fullgraph=True cannot include it")
def _linear_outside_graph(module, names, inp, weight, bias, activation, gemm):
    # Under torch.compile: deferred work must be queued with real tensors, never inside a traced
    # graph, and a fused layer's gradient must reach main_grad, which a compiled backward (where
    # AOTAutograd returns every gradient to autograd) would bypass: such layers run eagerly, with
    # their main_grad checks (Python attributes: traced, they recompiled per parameter).
    fused = module.fuse_wgrad_accumulation
    if fused:
        module._main_grad_of(weight, names[0], gemm=gemm or "")
        if bias is not None:
            module._main_grad_of(bias, names[1], required=False, gemm=gemm or "")
    return _linear_op(inp, weight, bias, None, None, module._layer_id, module.delay_wgrad_compute, activation,
                      fused, gemm)


def _main_grad_at_backward_only(param: torch.Tensor) -> bool:
    """A Megatron-FSDP parameter: its ``main_grad`` exists only from the backward on (allocated by
    ``get_main_grad()``), so the forward cannot check it; TE tells it by the same attribute."""
    return hasattr(param, "__fsdp_param__") and hasattr(param, "get_main_grad")


def _refuse_fp8(name: str, fp8_output, fp8_grad) -> None:
    """te.Linear's / te.LayerNormLinear's forward keywords, accepted off."""
    if fp8_output or fp8_grad:
        raise ArgumentError(f"splitgrad layer '{name}': FP8 is not supported: expected fp8_output=False and "
                            f"fp8_grad=False, got fp8_output={fp8_output!r}, fp8_grad={fp8_grad!r}")


def _refuse_unsupported(module: str, te_keywords: dict, defaults: dict) -> None:
    """TE keywords for features splitgrad does not have are accepted at their defaults only (so TE
    code that spells them out runs); anything else is refused by name."""
    unsupported = sorted(k for k, v in te_keywords.items() if defaults.get(k, object()) != v)
    if unsupported:
        raise TypeError(
            f"splitgrad.{module} got keyword argument(s) it does not support: {unsupported} "
            f"(te.{module} keywords accepted only at their defaults: {sorted(defaults)})"
        )


_PARALLEL_MODES = (None, "column", "row")


def _take_tensor_parallel_keywords(module: str, te_keywords: dict) -> dict:
    """Takes TE's tensor-parallel keywords out of ``te_keywords``. They are accepted where they
    describe one rank, as Megatron's TE layers pass them at tensor-parallel size 1: a
    parallel_mode, a tp_group of one rank, an RNG tracker to initialise the weights under. Tensor or
    sequence parallelism itself is refused, as other TE features splitgrad lacks are (TypeError).
    Returns the module's TE attributes: parallel_mode, sequence_parallel, tp_size,
    get_rng_state_tracker, rng_tracker_name."""
    tp_group = te_keywords.pop("tp_group", None)
    tp_size = te_keywords.pop("tp_size", 1)
    if tp_group is not None:
        if not torch.distributed.is_initialized():
            raise TypeError(f"splitgrad.{module}: got a tp_group but torch.distributed is not initialized")
        tp_size = torch.distributed.get_world_size(tp_group)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size != 1:
        raise TypeError(
            f"splitgrad.{module}: tensor parallelism is not supported: expected tp_size=1 (or a "
            f"tp_group of one rank), got {'a tp_group of ' if tp_group is not None else 'tp_size='}{tp_size!r}")
    if te_keywords.pop("sequence_parallel", False) is not False:
        raise TypeError(f"splitgrad.{module}: sequence parallelism is not supported: expected "
                        "sequence_parallel=False")
    # te.LayerNormMLP has set_parallel_mode (a bool) where the others have parallel_mode.
    if module == "LayerNormMLP":
        parallel_mode = None
        if not isinstance(te_keywords.pop("set_parallel_mode", False), bool):
            raise TypeError(f"splitgrad.{module}: expected a bool set_parallel_mode")
    else:
        parallel_mode = te_keywords.pop("parallel_mode", None)
        if parallel_mode not in _PARALLEL_MODES:
            raise TypeError(f"splitgrad.{module}: expected parallel_mode None, 'column' or 'row' (te's "
                            f"GemmParallelModes), got {parallel_mode!r}")
    tracker = te_keywords.pop("get_rng_state_tracker", None)
    if tracker is not None and not callable(tracker):
        raise TypeError(f"splitgrad.{module}: expected get_rng_state_tracker to be None or callable "
                        f"(Megatron's get_cuda_rng_tracker), got {type(tracker).__name__}")
    tracker_name = te_keywords.pop("rng_tracker_name", None)
    if tracker_name is not None and not isinstance(tracker_name, str):
        raise TypeError(f"splitgrad.{module}: expected rng_tracker_name to be None or a str, got {tracker_name!r}")
    return {"parallel_mode": parallel_mode, "sequence_parallel": False, "tp_size": 1,
            "get_rng_state_tracker": tracker, "rng_tracker_name": tracker_name}


def _check_sizes(module: str, **sizes) -> tuple[int, ...]:
    """The sizes as Python ints: ints, and integers that say they are (numpy's), not bools."""
    checked = []
    for arg, value in sizes.items():
        try:
            if isinstance(value, bool) or getattr(value, "dtype", None) == bool:
                raise TypeError
            checked.append(operator.index(value))
        except TypeError:
            checked.append(0)
        if checked[-1] <= 0:
            raise ArgumentError(f"splitgrad.{module}: expected a positive int {arg}, got {value!r}")
    return tuple(checked)


def _check_params_dtype(module: str, params_dtype) -> None:
    if params_dtype is not None and not (isinstance(params_dtype, torch.dtype) and params_dtype.is_floating_point):
        raise DTypeError(f"splitgrad.{module}: expected a floating-point params_dtype, got {params_dtype!r}")


def _factory(device, params_dtype) -> dict:
    return {
        "device": torch.device(device) if device is not None else _default_device(),
        "dtype": params_dtype if params_dtype is not None else torch.get_default_dtype(),
    }


def _drop_te_extra_state(state_dict: dict, prefix: str) -> None:
    """A Transformer Engine module's state_dict has an ``_extra_state`` entry (its FP8 metadata,
    empty without FP8): splitgrad keeps none, so a TE checkpoint loads strictly without it."""
    state_dict.pop(prefix + "_extra_state", None)


class _KeptInitMethod:
    """An init_method kept for reset_parameters(), as TE keeps it. A deep copy shares it; pickling
    (torch.save(model)) keeps it where it pickles (a module-level function, a functools.partial of
    one) and drops it otherwise (a lambda, a closure such as Megatron's init_method_normal), so
    the module still saves: reset_parameters() of the loaded copy then asks for it."""

    __slots__ = ("fn", "dropped")

    def __init__(self, fn=None, dropped=False):
        self.fn, self.dropped = fn, dropped

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        try:
            pickle.dumps(self.fn)
        except Exception:  # pickle raises several types (PicklingError, AttributeError, TypeError)
            return (_KeptInitMethod, (None, True))
        return (_KeptInitMethod, (self.fn, self.dropped))


class _DeferredWgradModule(nn.Module):
    """What splitgrad's modules share: one registration with the deferred-wgrad store (every GEMM of
    the module queues under its id, so one backward_dw() runs one backward pass's work of all of
    them), its name, TE's hook API, the pending-work guards, and how a linear map runs under
    torch.export, torch.compile, jit.trace and torch.func (``_apply_linear``). A subclass sets
    ``delay_wgrad_compute`` and ``fuse_wgrad_accumulation``, creates its parameters, then calls
    ``_register(name)``; ``_default_name`` names it when no name is given."""

    def _register(self, name: str | None) -> None:
        self._layer = _C.LayerHandle(name or "")
        self._layer_id = self._layer.id
        if not name:
            self._layer.name = self._default_name(self._layer_id)
        self._reduce_hooks: list[Callable] = []
        self._reduce_hook_handles: list = []
        self.register_state_dict_pre_hook(_DeferredWgradModule._state_dict_pre_hook)
        for param_name in self._deferred_parameter_names():
            self._mark_deferred(getattr(self, param_name, None))

    def _deferred_parameter_names(self) -> list[str]:
        """The parameters whose gradients the module's GEMMs compute (deferred with
        delay_wgrad_compute), as opposed to a norm's."""
        return ["weight", "bias"]

    def _mark_deferred(self, param) -> None:
        # TE's mark on a delayed module's GEMM parameters: Megatron's DDP then reduces them from the
        # module's register_wgrad_accumulation_and_reduce_hooks, not from AccumulateGrad's hook
        # (which runs in the backward, before backward_dw()).
        if self.delay_wgrad_compute and isinstance(param, nn.Parameter):
            param.skip_backward_post_hook = True

    def _default_name(self, layer_id) -> str:
        raise NotImplementedError

    # Whether torch.jit.trace can record this module's op (the grouped op's optional-tensor lists
    # are an argument type the tracer does not record).
    _jit_traceable = True

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling it.
        recorders = "torch.export / torch.jit.trace" if self._jit_traceable else "torch.export"
        raise TypeError(
            f"splitgrad layer '{self.name}' cannot be compiled by torch.jit.script (TorchScript is "
            f"deprecated and cannot express its deferred-wgrad state); use torch.compile, or "
            f"{recorders}, which record it as a regular layer"
        )

    @property
    def name(self) -> str:
        return self._layer.name

    @name.setter
    def name(self, value: str) -> None:
        self._layer.name = str(value)

    def _init_rng(self):
        """Where the weights are drawn: under the RNG tracker's fork when one was given, as TE
        initialises them (Megatron's get_cuda_rng_tracker), else the default generators."""
        tracker = getattr(self, "get_rng_state_tracker", None)
        if tracker is None:
            return contextlib.nullcontext()
        name = getattr(self, "rng_tracker_name", None)
        return tracker().fork(name) if name else tracker().fork()

    def _warn_if_fused_functional(self, weight: torch.Tensor, name: str) -> None:
        """On the functional path (torch.func, forward-mode AD) a fused layer's gradient is plain
        autograd's: a backward outside the transform puts it in .grad, not main_grad."""
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled() and _base_of(weight).requires_grad:
            warnings.warn(
                f"splitgrad layer '{self.name}' (fuse_wgrad_accumulation=True) runs inside a torch.func "
                "transform or forward-mode AD with its own parameters: a backward through this "
                f"call outside the transform adds its gradient to {name}.grad, not main_grad. "
                "Pass the parameters through torch.func.functional_call, or fold .grad into main_grad.",
                stacklevel=5)

    def need_backward_dw(self) -> bool:
        """TE's name: whether this module defers its weight gradients to :meth:`backward_dw`
        (built with delay_wgrad_compute=True)."""
        return self.delay_wgrad_compute

    def _check_forward_args(self, inp, is_first_microbatch) -> None:
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch: expected None or a bool, got {is_first_microbatch!r}")
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"splitgrad layer '{self.name}': expected a torch.Tensor input, got {type(inp).__name__}")
        if self._reduce_hooks and not _exporting():  # export's fake parameters get no hooks
            self._refresh_reduce_hooks()
        if self.delay_wgrad_compute and DistributedDataParallel._active_ddp_module is not None:
            self._check_not_reduced_by_ddp(DistributedDataParallel._active_ddp_module)

    def _check_not_reduced_by_ddp(self, ddp: DistributedDataParallel) -> None:
        """torch's DDP all-reduces each gradient from AccumulateGrad's hook, during the backward:
        before backward_dw() has computed a delayed layer's. Its reduction would silently leave
        those gradients local, so a delayed layer it reduces is refused."""
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return  # no_sync(): DDP reduces nothing in this backward
        reduced = ddp.__dict__.get("_splitgrad_reduced_ids")
        if reduced is None:
            params = getattr(ddp, "_module_parameters", None) or list(ddp.module.parameters())
            reduced = ddp.__dict__["_splitgrad_reduced_ids"] = {id(p) for p in params}
        names = [n for n in self._deferred_parameter_names()
                 if id(getattr(self, n, None)) in reduced and getattr(self, n).requires_grad]
        if names:
            raise RuntimeError(
                f"splitgrad layer '{self.name}' (delay_wgrad_compute=True) runs inside "
                "torch.nn.parallel.DistributedDataParallel, which all-reduces gradients during the "
                f"backward, before backward_dw() computes this layer's ({', '.join(names)}): they would "
                "stay unreduced. Reduce with splitgrad.distributed.GradReducer (which waits for the "
                "deferred gradients), or build the layer with delay_wgrad_compute=False."
            )

    def _linear_path(self, inp: torch.Tensor, *used: torch.Tensor | None) -> str:
        """How this forward's linear maps run: "export" (torch.export), "functional" (torch.func
        transforms, forward-mode AD with a tangent on ``inp`` or on a weight or bias the maps use:
        ``used``, as read for this forward, so a parametrized or substituted weight's tangent
        counts), "compile" (under torch.compile), "trace" (jit.trace), "op"."""
        if _exporting():
            return "export"
        if _differentiated_functionally(inp, *used):
            return "functional"
        if torch.compiler.is_compiling():
            return "compile"
        if torch.jit.is_tracing():
            return "trace"
        return "op"

    def _apply_linear(self, path: str, inp, weight, bias, names: tuple[str, str] = ("weight", "bias"),
                      gemm: str = "", activation: str | None = None):
        """inp·weightᵀ + bias through splitgrad's linear op, queued under this module's id; ``path``
        from _linear_path(), ``names`` name the parameters in messages, and ``gemm`` the GEMM in a
        module with several ("fc1": "splitgrad layer 'mlp' (fc1): ..."). ``activation``: the op's
        input_activation (act(inp)·weightᵀ + bias, a deferred wgrad keeping ``inp``); not on the
        functional path, where the caller applies the activation."""
        weight_main_grad = bias_main_grad = None
        # export records an unfused call; functional gradients are returned, not accumulated;
        # compiled code checks them outside the graph (_linear_outside_graph)
        if self.fuse_wgrad_accumulation and path not in ("export", "functional", "compile"):
            weight_main_grad = self._main_grad_of(weight, names[0], gemm=gemm)
            if bias is not None:
                bias_main_grad = self._main_grad_of(bias, names[1], required=False, gemm=gemm)
        if path == "functional" or (gemm and path not in ("export", "compile")):
            # The op's own checks (the functional path runs without the op), naming the GEMM. Autocast
            # casts a floating input to its dtype before the product.
            cast = _autocast_enabled(inp.device.type) and inp.is_floating_point()
            _C.check_gemm_args(self._layer_id, gemm, inp, weight, bias, weight_main_grad, bias_main_grad, *names,
                               inp.dtype if cast else None, activation)
        if path in ("export", "trace"):
            # A graph meant to outlive this process records a regular, unfused call under no
            # layer id (0): it depends on no process-local registration, and its gradients go to
            # .grad at once.
            if path == "trace":  # its backward will not name this layer (the reduce hooks)
                self._layer.note_ran_untracked()
            return _linear_op(inp, weight, bias, None, None, 0, False, activation)
        if path == "functional":  # nn.Linear's own differentiable op
            assert activation is None, "the functional path applies the activation outside"
            self._layer.note_ran_untracked()
            self._warn_if_fused_functional(weight, names[0])
            return nn.functional.linear(inp, weight, bias)
        # A fused layer's backward reads each main_grad when it computes that gradient, as TE's does
        # (the op's lazy_main_grad): checked here already where it exists, but what the backward
        # finds then is what it adds to.
        fused = self.fuse_wgrad_accumulation
        if path == "compile" and (self.delay_wgrad_compute or fused):
            return _linear_outside_graph(self, names, inp, weight, bias, activation, gemm or None)
        if path == "op":
            self._note_if_captured(inp)
        return _linear_op(inp, weight, bias, None, None, self._layer_id, self.delay_wgrad_compute, activation,
                          fused, gemm or None)

    def _note_if_captured(self, inp: torch.Tensor) -> None:
        """A forward captured into a CUDA graph: its replays run the backward without the op, which
        the reduce hooks learn (LayerHandle.ran_untracked)."""
        if self._reduce_hooks and inp.is_cuda and torch.cuda.is_current_stream_capturing():
            self._layer.note_ran_untracked()

    def _label(self, gemm: str = "") -> str:
        """"splitgrad layer 'mlp' (fc1)", as the C++ checks name a layer and its GEMM."""
        return f"splitgrad layer '{self.name}'" + (f" ({gemm})" if gemm else "")

    def _main_grad_of(self, param: torch.Tensor, what: str, required: bool = True,
                      gemm: str = "") -> torch.Tensor | None:
        """``param.main_grad``, checked. The weight's is required; a bias without one gets its
        gradient in ``bias.grad``, as te.Linear does. None where no backward can reach ``param``
        (frozen, or grad mode off: an eval or generation forward needs no main_grad) and for a
        Megatron-FSDP parameter, whose main_grad the backward gets from ``get_main_grad()``."""
        if not param.requires_grad or not torch.is_grad_enabled():
            return None
        main_grad = None
        if not _main_grad_at_backward_only(param):
            main_grad = getattr(param, "main_grad", None)
            if main_grad is None and not required:
                return None
            if main_grad is None and not param.is_leaf:
                raise MainGradError(
                    f"{self._label(gemm)}: fuse_wgrad_accumulation=True needs {what}.main_grad, "
                    f"but {what} is computed here (torch.nn.utils.prune, a parametrization, or a "
                    "functional_call substitute made it from other tensors), and a computed tensor "
                    "takes no main_grad: its gradient flows on to the tensors it came from. Build "
                    "the layer with fuse_wgrad_accumulation=False to train it that way"
                )
            if main_grad is None:
                raise MainGradError(
                    f"{self._label(gemm)}: fuse_wgrad_accumulation=True needs {what}.main_grad, "
                    f"an fp32 tensor of shape {list(param.shape)} (Megatron's contract); it is not set"
                )
            if not isinstance(main_grad, torch.Tensor):
                raise MainGradError(
                    f"{self._label(gemm)}: expected {what}.main_grad to be a torch.Tensor, "
                    f"got {type(main_grad).__name__}"
                )
            _C.check_main_grad(self._layer_id, gemm, what, main_grad, param)
        # Megatron's contract: its grad hooks must not add .grad into main_grad again. Set here, in
        # Python, once per forward: the backward that follows adds this layer's gradient to main_grad.
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
        return main_grad

    def backward_dw(self) -> None:
        """Run this module's deferred wgrad for the oldest backward pass still pending (every GEMM
        of the module, last applied first).

        Does nothing when the module was built with delay_wgrad_compute=False (as in TE); raises
        RuntimeError naming the module when a delayed module has nothing pending.
        """
        if self.delay_wgrad_compute:
            self._layer.backward_dw()

    def pending_wgrads(self) -> int:
        """Deferred wgrad items queued for this module (one per GEMM applied)."""
        return self._layer.pending()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable) -> None:
        """TE's name, for gradient reducers. A hook that takes an argument is a grad-ready hook
        (:func:`splitgrad.register_grad_ready_hook`) on each parameter of this module: ``hook(param)``
        once per backward pass, after the last contribution to ``param`` (from this or any module it
        is tied to); registered on several modules sharing a parameter, it runs once for it.

        A hook that takes no argument, or only ``*args``, is called as TE calls it: ``hook()``, once
        per backward pass of the module, when every parameter of the module has its complete
        gradient of that pass. Megatron's DDP registers one such hook per parameter, on each module
        holding it (for the parameters TE marks ``skip_backward_post_hook``, as splitgrad's delayed
        modules mark theirs)."""
        if not callable(hook):
            raise TypeError(f"expected a callable hook, got {type(hook).__name__}")
        self._reduce_hooks.append(hook)
        self._install_reduce_hooks()

    def _own_parameters(self) -> list[torch.Tensor]:
        """The module's parameters, each once (a parameter tied within the module is registered
        under several names)."""
        unique: dict[int, torch.Tensor] = {}
        for p in self._parameters.values():
            if p is not None:
                unique.setdefault(id(p), p)
        return list(unique.values())

    def _install_reduce_hooks(self) -> None:
        for handle in self._reduce_hook_handles:
            handle.remove()
        self._reduce_hook_handles = []
        own = self._own_parameters()
        self._reduce_hook_flags = tuple((p, p.requires_grad) for p in own)
        params = [p for p in own if p.requires_grad]
        pass_hooks = self.__dict__.setdefault("_pass_hooks", {})
        for hook in self._reduce_hooks:
            if _takes_the_parameter(hook):
                self._reduce_hook_handles += [_SharedParamHook.register(p, hook, self) for p in params]
            else:
                call = pass_hooks.get(id(hook)) or pass_hooks.setdefault(id(hook), _ModulePassHook(hook))
                call.watch(params, self)
                self._reduce_hook_handles += [register_grad_ready_hook(p, call) for p in params]

    def _keep_init_methods(self, **methods) -> None:
        for key, fn in methods.items():
            self.__dict__[f"_kept_{key}"] = _KeptInitMethod(fn)

    def _init_method(self, key: str, given):
        """``given``, else the init method of that keyword kept at construction (None: nn.Linear's)."""
        if given is not None:
            return given
        kept = self.__dict__.get(f"_kept_{key}")  # absent in a module pickled before it was kept
        if kept is not None and kept.dropped:
            raise ArgumentError(
                f"splitgrad layer '{self.name}': the {key} given at construction could not be pickled "
                f"(a lambda or a closure) and was not saved with the module; pass "
                f"reset_parameters({key}=...)")
        return kept.fn if kept is not None else None

    def _refresh_reduce_hooks(self) -> None:
        """A parameter frozen, unfrozen or replaced (without __setattr__) since the hooks were
        installed: hooks go where grads do."""
        now = self._own_parameters()
        installed = self._reduce_hook_flags
        if self._reduce_hooks and (len(now) != len(installed) or any(
                p is not q or p.requires_grad != flag for p, (q, flag) in zip(now, installed))):
            self._install_reduce_hooks()

    def _apply(self, fn, recurse=True):
        # .to()/.cuda()/.double(), to_empty(): PyTorch converts each parameter and its .grad, in
        # place or into a new Parameter object (across some devices, under
        # set_overwrite_module_params_on_conversion or swap_module_params_on_conversion), one per
        # module holding it. The deferred work still owed to these parameters runs first, so their
        # .grad is complete, as plain autograd's is, when PyTorch converts or copies it (to every
        # copy of a tied parameter). TE's mark and the reduce hooks then follow new objects.
        if self.__dict__.get("_reduce_hooks") and torch.__future__.get_swap_module_params_on_conversion():
            # PyTorch cannot swap a tensor with weak references (the hooks'): refused here, before
            # any parameter converts, rather than half-way through the module.
            raise ArgumentError(
                f"splitgrad layer '{self.name}': torch.__future__.set_swap_module_params_on_conversion(True) "
                "cannot swap parameters that have reduce hooks (register_wgrad_accumulation_and_reduce_hooks, "
                "GradReducer): convert the module before registering them, or without swap mode")
        if "_layer" in self.__dict__ and _C.pending_wgrads():
            own = [p for p in self._parameters.values() if p is not None]
            if own and _C.layers_with_pending_wgrads(own):
                _C.backward_dw_all(own)
        result = super()._apply(fn, recurse)
        if "_layer" in self.__dict__:
            for name in self._deferred_parameter_names():
                self._mark_deferred(getattr(self, name, None))
            if self._reduce_hooks:
                self._install_reduce_hooks()
        return result

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in self._parameters and "_layer" in self.__dict__:
            if name in self._deferred_parameter_names():
                self._mark_deferred(value)
            if self._reduce_hooks:
                self._install_reduce_hooks()  # tied after the hooks were registered: follow the new parameter

    def __getstate__(self):
        # the hook handles belong to this module's parameters: a copy installs its own (__setstate__)
        state = self.__dict__.copy()
        state["_reduce_hook_handles"] = []
        state["_pass_hooks"] = {}
        return state

    def __setstate__(self, state):
        # deepcopy / unpickling gives the copy a layer registration of its own; keep the id in step,
        # and give a copy named by default a default name of its own
        super().__setstate__(state)
        if self._layer.name == self._default_name(state.get("_layer_id")):
            self._layer.name = self._default_name(self._layer.id)
        self._layer_id = self._layer.id
        self._reduce_hook_handles = []
        if self._reduce_hooks:
            self._install_reduce_hooks()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _drop_te_extra_state(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @staticmethod
    def _state_dict_pre_hook(module, prefix, keep_vars):
        if module._layer.pending():
            check_no_pending(f"state_dict() of '{module.name}'", module._own_parameters())

    def __del__(self):
        for handle in self.__dict__.get("_reduce_hook_handles", ()):  # its hooks go with it
            handle.remove()
        layer = self.__dict__.get("_layer")
        if layer is None:
            return
        name = layer.name  # read before release(): a released layer no longer has a name
        dropped = layer.release()
        if dropped:
            warnings.warn(
                f"splitgrad layer '{name}' was deleted with {dropped} deferred wgrad item(s) "
                "pending: their stashed tensors were freed and those gradient contributions discarded "
                "(the grad-ready hooks of parameters it shares do not fire for those backward passes). "
                "Call backward_dw() before deleting a layer.",
                PendingWgradWarning,
                stacklevel=2,
            )


class Linear(_DeferredWgradModule):
    """y = x·Wᵀ + b, whose weight and bias gradients can be deferred to :meth:`backward_dw`.

    Args (Transformer Engine's te.Linear keywords):
        in_features, out_features: sizes of x's last dimension and of y's.
        bias: whether the layer has a bias.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (default: that of a ``with torch.device(...)`` block or
            ``torch.set_default_device`` where one is set, else CUDA when available, else the CPU).
        delay_wgrad_compute: queue the weight/bias gradient in backward; compute it in backward_dw().
        fuse_wgrad_accumulation: add the weight gradient in fp32 into ``weight.main_grad`` (set by
            the caller, as Megatron does) instead of ``weight.grad``, and the bias gradient into
            ``bias.main_grad`` if the bias has one, else into ``bias.grad`` (as te.Linear does);
            sets ``param.grad_added_to_main_grad = True`` where that attribute exists.
        init_method: called on the weight to initialise it (default: nn.Linear's initialisation).
        return_bias: return ``(x·Wᵀ, b)`` and leave adding the bias to the caller (te.Linear's).
        name: used in messages about this layer (default ``"Linear(in, out)#id"``; see name_layers).

    Parameters live on the module: tie them by assignment (``model[1].weight = model[0].weight``);
    every contribution to a shared parameter accumulates.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | int | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        return_bias: bool = False,
        name: str | None = None,
        **te_keywords,
    ) -> None:
        super().__init__()
        self.__dict__.update(_take_tensor_parallel_keywords("Linear", te_keywords))
        _refuse_unsupported("Linear", te_keywords, _TE_LINEAR_DEFAULTS)
        in_features, out_features = _check_sizes("Linear", in_features=in_features, out_features=out_features)
        _check_params_dtype("Linear", params_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = bool(return_bias)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        factory = _factory(device, params_dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self._register(name)
        self._keep_init_methods(init_method=init_method)  # as TE: reset_parameters() after to_empty()
        self.reset_parameters()

    def _default_name(self, layer_id) -> str:
        return f"Linear({self.in_features}, {self.out_features})#{layer_id}"

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """Draws the parameters again: the weight by ``init_method``, else by the one given at
        construction, with a zero bias (as TE); else both as nn.Linear."""
        with self._init_rng():
            _reset_linear(self.weight, self.bias, self._init_method("init_method", init_method))

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, fp8_output: bool = False,
                fp8_grad: bool = False) -> torch.Tensor:
        """y = inp·Wᵀ + b for ``inp`` of shape [*, in_features].

        ``is_first_microbatch`` is accepted for te.Linear compatibility; it does not change the
        gradients (they accumulate over micro-batches either way). ``fp8_output`` / ``fp8_grad``:
        te.Linear's, accepted off (splitgrad has no FP8).
        """
        _refuse_fp8(self.name, fp8_output, fp8_grad)
        self._check_forward_args(inp, is_first_microbatch)
        # return_bias (te.Linear): the caller adds the bias, so autograd owns its gradient.
        weight, bias = self.weight, None if self.return_bias else self.bias
        path = self._linear_path(inp, weight, bias)
        with _typed_errors():
            out = self._apply_linear(path, inp, weight, bias)
        return (out, self.bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"delay_wgrad_compute={self.delay_wgrad_compute}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, name={self.name!r}"
        )


@contextlib.contextmanager
def _typed_errors():
    """The ops' ValueError/TypeError as splitgrad's typed errors (messages unchanged)."""
    try:
        yield
    except ValueError as error:
        kind = MainGradError if "main_grad" in str(error) else ArgumentError
        raise kind(str(error)) from None
    except TypeError as error:
        raise DTypeError(str(error)) from None


def _reset_linear(weight, bias, init_method) -> None:
    """nn.Linear's initialisation (kaiming-uniform weight, uniform bias in ±1/sqrt(fan_in)), or
    TE's with an ``init_method``: ``init_method(weight)`` and a zero bias (TE and Megatron zero
    every GEMM bias)."""
    with torch.no_grad():
        if init_method is not None:
            init_method(weight)
            if bias is not None:
                bias.zero_()
        else:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            if bias is not None:
                bound = 1.0 / math.sqrt(weight.shape[1])
                nn.init.uniform_(bias, -bound, bound)


def _takes_the_parameter(fn: Callable) -> bool:
    """Whether a reduce hook has a positional parameter for the parameter (``fn(param)``), rather
    than TE's no-argument form (``fn()``, ``fn(*unused)``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


class _SharedReduceHooks:
    """The per-parameter reduce hooks modules registered on a parameter, kept on the parameter
    (``param.__dict__``) as its grad-ready hooks are: copies and pickles get none."""

    def __init__(self) -> None:
        self.entries: dict[int, list] = {}  # id(hook) -> [hook, grad-ready handle, owners' ids]

    def __reduce__(self):
        return (_SharedReduceHooks, ())

    def __deepcopy__(self, memo):
        return _SharedReduceHooks()


_SHARED_HOOKS_ATTR = "_splitgrad_shared_reduce_hooks"


class _SharedParamHook:
    """A per-parameter reduce hook as modules register it: one grad-ready hook per (parameter, hook)
    pair, however many modules holding the parameter registered that hook (a reducer registered on
    every module must reduce a tied weight once, not once per module). ``remove()`` drops this
    module's share; the last one removes the hook."""

    _lock = threading.Lock()

    def __init__(self, param: torch.Tensor, hook_id: int, owner: int) -> None:
        self._param, self._hook_id, self._owner = weakref.ref(param), hook_id, owner

    @classmethod
    def register(cls, param: torch.Tensor, hook: Callable, module: nn.Module) -> "_SharedParamHook":
        with cls._lock:
            shared = param.__dict__.get(_SHARED_HOOKS_ATTR)
            if shared is None:
                shared = param.__dict__[_SHARED_HOOKS_ATTR] = _SharedReduceHooks()
            entry = shared.entries.get(id(hook))
            if entry is None:
                entry = shared.entries[id(hook)] = [hook, register_grad_ready_hook(param, hook), set()]
            entry[2].add(id(module))
        return cls(param, id(hook), id(module))

    def remove(self) -> None:
        param = self._param()
        if param is None:
            return
        with self._lock:
            shared = param.__dict__.get(_SHARED_HOOKS_ATTR)
            entry = shared.entries.get(self._hook_id) if shared is not None else None
            if entry is None:
                return
            entry[2].discard(self._owner)
            if not entry[2]:
                entry[1].remove()
                del shared.entries[self._hook_id]


class _ModulePassHook:
    """Calls a TE-style ``hook()`` once per backward pass of a module: when each parameter of the
    module that requires grad has had its gradient-ready event of that pass, and the module's ops
    ran their backward in it. Events are told apart by pass (``_C.grad_ready_pass()``); a pass
    in which other splitgrad layers' ops ran but not the module's (``_C.grad_ready_layer_ran()``
    False) is none of its passes, unless the module once ran where its backward is not its op's
    (``ran_untracked``: a traced or captured graph, a torch.func transform). Kept across
    re-installs (re-tying), so a pass under way is not lost."""

    # Passes with some of the module's parameters ready, kept until the rest are: a bound against
    # those that never complete (backward(inputs=...) with some of them), far above the passes a
    # schedule keeps outstanding (a delayed LayerNorm module's norm is ready at each backward, its
    # GEMM's parameters at each backward_dw()).
    _KEEP = 4096

    def __init__(self, hook: Callable) -> None:
        self._hook = hook
        self._params: list[torch.Tensor] = []
        self._module: Callable[[], nn.Module | None] = lambda: None
        self._passes: dict[int | None, set[int]] = {}  # pass id -> ids of the parameters ready
        self._lock = threading.Lock()

    def watch(self, params: list[torch.Tensor], module: nn.Module) -> None:
        with self._lock:
            self._params = list(params)
            self._module = weakref.ref(module)  # the parameters' hooks hold this object

    def __call__(self, param: torch.Tensor) -> None:
        module = self._module()
        if module is None:
            return  # deleted (its hooks are being removed): no pass is its any more
        if _C.grad_ready_layer_ran(module._layer_id) is False and not module._layer.ran_untracked:
            return  # other layers' ops ran in this pass, the module's did not
        pass_id = grad_ready_pass()
        with self._lock:
            ready = self._passes.setdefault(pass_id, set())
            ready.add(id(param))
            if not all(id(p) in ready for p in self._params if p.requires_grad):
                while len(self._passes) > self._KEEP:
                    del self._passes[next(iter(self._passes))]
                return
            del self._passes[pass_id]
        self._hook()


def name_layers(model: nn.Module, prefix: str = "") -> None:
    """Name every splitgrad layer (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear) in ``model``
    after its path (``"blocks.0.fc1"``), so messages about pending work and errors say which layer
    they mean."""
    from ._grouped_linear import GroupedLinear  # it imports this module

    for path, module in model.named_modules(prefix=prefix):
        if isinstance(module, (_DeferredWgradModule, GroupedLinear)):
            module.name = path or type(model).__name__
