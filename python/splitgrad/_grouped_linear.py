"""splitgrad.GroupedLinear: MoE experts over one tensor's rows, te.GroupedLinear's API, with
deferred weight gradients that equal per-expert plain autograd's."""

from __future__ import annotations

import math
import operator
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from . import _C
from ._deferred import check_no_pending, register_grad_ready_hook
from ._errors import ArgumentError, DTypeError, MainGradError, PendingWgradWarning
from ._linear import _TE_DEFAULTS, _default_device, _drop_te_extra_state, _exporting, _takes_an_argument

__all__ = ["GroupedLinear"]

# te.GroupedLinear's keywords accepted at their defaults: te.Linear's, and these.
_GROUPED_TE_DEFAULTS = {**_TE_DEFAULTS, "return_bias": False, "save_original_input": False}

_grouped_linear_op = torch.ops.splitgrad.grouped_linear.default


@torch.compiler.disable(
    reason="a splitgrad.GroupedLinear with delay_wgrad_compute or fuse_wgrad_accumulation runs "
    "eagerly (a graph break): its deferred work and main_grad accumulation happen outside compiled "
    "graphs")
def _grouped_outside_graph(*args):
    return _grouped_linear_op(*args)


class GroupedLinear(nn.Module):
    """``num_gemms`` linear maps (MoE experts) over one tensor's rows: rows
    ``[offset_i, offset_i + m_splits[i])`` of the input go through expert ``i``,
    ``y_i = x_i·W_iᵀ + b_i``, whose weight and bias gradients can be deferred to :meth:`backward_dw`.

    Args (Transformer Engine's te.GroupedLinear keywords):
        num_gemms: number of experts.
        in_features, out_features: sizes of x's last dimension and of y's.
        bias: whether every expert has a bias.
        params_dtype, device, delay_wgrad_compute, fuse_wgrad_accumulation, init_method, name: as
            for :class:`splitgrad.Linear`, per expert (``init_method`` is called on each weight).

    Parameters ``weight0`` … ``weight{n-1}`` and ``bias0`` … are parameters of their own: tie them by
    assignment (``layer.weight1 = layer.weight0``, ``layer.weight0 = other.weight``), give each its
    ``main_grad``; every contribution to a shared parameter accumulates. One application queues one
    deferred item (all experts), run by one ``backward_dw()``.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | int | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        name: str | None = None,
        **te_keywords,
    ) -> None:
        super().__init__()
        unsupported = sorted(k for k, v in te_keywords.items() if _GROUPED_TE_DEFAULTS.get(k, object()) != v)
        if unsupported:
            raise TypeError(
                f"splitgrad.GroupedLinear got keyword argument(s) it does not support: {unsupported} "
                f"(te.GroupedLinear keywords accepted only at their defaults: {sorted(_GROUPED_TE_DEFAULTS)})"
            )
        for arg, value in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ArgumentError(f"splitgrad.GroupedLinear: expected a positive int {arg}, got {value!r}")
        if params_dtype is not None and not (isinstance(params_dtype, torch.dtype) and params_dtype.is_floating_point):
            raise DTypeError(f"splitgrad.GroupedLinear: expected a floating-point params_dtype, got {params_dtype!r}")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bool(bias)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        factory = {
            "device": torch.device(device) if device is not None else _default_device(),
            "dtype": params_dtype if params_dtype is not None else torch.get_default_dtype(),
        }
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features, **factory)))
        for i in range(num_gemms if bias else 0):
            self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, **factory)))
        self._layer = _C.LayerHandle(name or "")
        self._layer_id = self._layer.id
        if not name:
            self._layer.name = self._default_name(self._layer_id)
        self._reduce_hooks: list[Callable] = []
        self._reduce_hook_handles: list = []
        self.register_state_dict_pre_hook(GroupedLinear._state_dict_pre_hook)
        self.reset_parameters(init_method)

    def _default_name(self, layer_id) -> str:
        return f"GroupedLinear({self.num_gemms}, {self.in_features}, {self.out_features})#{layer_id}"

    @property
    def weights(self) -> list[nn.Parameter]:
        """weight0 … weight{n-1}, as the module holds them now (after any tying)."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> list[nn.Parameter]:
        """bias0 … bias{n-1}, or [] without bias."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """Each expert as nn.Linear (or ``init_method(weight_i)``)."""
        with torch.no_grad():
            for weight in self.weights:
                if init_method is not None:
                    init_method(weight)
                else:
                    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            bound = 1.0 / math.sqrt(self.in_features)
            for bias in self.biases:
                nn.init.uniform_(bias, -bound, bound)

    def __prepare_scriptable__(self):
        raise TypeError(
            f"splitgrad layer '{self.name}' cannot be compiled by torch.jit.script; use torch.compile, "
            "or torch.export / torch.jit.trace, which record it as a regular layer"
        )

    @property
    def name(self) -> str:
        return self._layer.name

    @name.setter
    def name(self, value: str) -> None:
        self._layer.name = str(value)

    def _splits_tensor(self, m_splits) -> torch.Tensor:
        """m_splits as the op takes it: an int64 tensor. A list becomes a CPU tensor; a tensor stays
        on its device (another integer dtype is converted there, without a host synchronisation).
        Counts, signs, sums and devices are checked by the op, which names this layer."""
        who = f"splitgrad layer '{self.name}'"
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dtype == torch.bool or m_splits.is_floating_point() or m_splits.is_complex():
                raise DTypeError(f"{who}: expected m_splits of an integer dtype (row counts), got {m_splits.dtype}")
            return m_splits if m_splits.dtype == torch.int64 else m_splits.to(torch.int64)
        if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
            raise TypeError(f"{who}: expected m_splits as a list of ints or an integer tensor, got {type(m_splits).__name__}")
        counts = []
        for i, s in enumerate(m_splits):
            try:  # ints, and integers that say they are (numpy's): not floats, not bools
                if isinstance(s, (bool, torch.Tensor)) or getattr(s, "dtype", None) == bool:
                    raise TypeError
                counts.append(operator.index(s))
            except TypeError:
                raise DTypeError(f"{who}: expected m_splits of ints (row counts), got m_splits[{i}] = {s!r}") from None
        return torch.tensor(counts, dtype=torch.int64)

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """y = per-expert ``x_i·W_iᵀ + b_i`` for ``inp`` of shape [*, in_features] (flattened to
        [tokens, in_features]); ``m_splits``: rows per expert, a list of ints or an integer tensor
        (CPU, or the input's device: passed on without a host synchronisation).

        ``is_first_microbatch`` is accepted for te.GroupedLinear compatibility; it does not change the
        gradients (they accumulate over micro-batches either way).
        """
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch: expected None or a bool, got {is_first_microbatch!r}")
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"splitgrad layer '{self.name}': expected a torch.Tensor input, got {type(inp).__name__}")
        splits = self._splits_tensor(m_splits)
        weights, biases = self.weights, self.biases
        weight_main_grads: list = []
        bias_main_grads: list = []
        if self.fuse_wgrad_accumulation and not _exporting():
            weight_main_grads = [self._main_grad_of(w, f"weight{i}") for i, w in enumerate(weights)]
            bias_main_grads = [self._main_grad_of(b, f"bias{i}", required=False) for i, b in enumerate(biases)]
        try:
            if _exporting() or torch.jit.is_tracing():
                # A graph meant to outlive this process records a regular, unfused call (layer 0).
                return _grouped_linear_op(inp, splits, weights, biases, [], [], 0, False)
            args = (inp, splits, weights, biases, weight_main_grads, bias_main_grads, self._layer_id,
                    self.delay_wgrad_compute)
            if (self.delay_wgrad_compute or self.fuse_wgrad_accumulation) and torch.compiler.is_compiling():
                return _grouped_outside_graph(*args)
            return _grouped_linear_op(*args)
        except ValueError as error:
            kind = MainGradError if "main_grad" in str(error) else ArgumentError
            raise kind(str(error)) from None
        except TypeError as error:
            raise DTypeError(str(error)) from None

    def _main_grad_of(self, param: torch.Tensor, what: str, required: bool = True) -> torch.Tensor | None:
        """``param.main_grad``, checked (the op checks its shape, dtype and device). Every weight's
        is required; a bias without one gets its gradient in ``.grad``, as te.GroupedLinear does."""
        if not param.requires_grad:
            return None
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None and not required:
            return None
        if main_grad is None:
            raise MainGradError(
                f"splitgrad layer '{self.name}': fuse_wgrad_accumulation=True needs {what}.main_grad, "
                f"an fp32 tensor of shape {list(param.shape)} (Megatron's contract); it is not set")
        if not isinstance(main_grad, torch.Tensor):
            raise MainGradError(
                f"splitgrad layer '{self.name}': expected {what}.main_grad to be a torch.Tensor, "
                f"got {type(main_grad).__name__}")
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
        return main_grad

    def backward_dw(self) -> None:
        """Run this layer's deferred wgrad (every expert) for the oldest backward pass still pending.

        Does nothing when the layer was built with delay_wgrad_compute=False (as in TE); raises
        RuntimeError naming the layer when a delayed layer has nothing pending.
        """
        if self.delay_wgrad_compute:
            self._layer.backward_dw()

    def pending_wgrads(self) -> int:
        """Deferred wgrad items queued for this layer (one per application, all experts)."""
        return self._layer.pending()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable) -> None:
        """TE's name: run ``hook`` for each parameter of this layer (each expert's weight and bias,
        a parameter shared by experts once) once its gradient for a backward pass is complete.
        ``hook(param)`` is called if it takes an argument, else ``hook()`` as in TE."""
        if not callable(hook):
            raise TypeError(f"expected a callable hook, got {type(hook).__name__}")
        self._reduce_hooks.append(hook)
        self._install_reduce_hooks()

    def _own_parameters(self) -> list[torch.Tensor]:
        """Each parameter once (experts may share one)."""
        unique: dict[int, torch.Tensor] = {}
        for p in self.weights + self.biases:
            unique.setdefault(id(p), p)
        return list(unique.values())

    def _install_reduce_hooks(self) -> None:
        for handle in self._reduce_hook_handles:
            handle.remove()
        self._reduce_hook_handles = []
        for hook in self._reduce_hooks:
            call = hook if _takes_an_argument(hook) else (lambda _param, hook=hook: hook())
            for param in self._own_parameters():
                if param.requires_grad:
                    self._reduce_hook_handles.append(register_grad_ready_hook(param, call))

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if (name.startswith("weight") or name.startswith("bias")) and self.__dict__.get("_reduce_hooks"):
            self._install_reduce_hooks()  # tied after the hooks were registered: follow the new parameter

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_reduce_hook_handles"] = []
        return state

    def __setstate__(self, state):
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
        layer = self.__dict__.get("_layer")
        if layer is None:
            return
        name = layer.name
        dropped = layer.release()
        if dropped:
            warnings.warn(
                f"splitgrad layer '{name}' was deleted with {dropped} deferred wgrad item(s) "
                "pending: their stashed tensors were freed and those gradient contributions discarded. "
                "Call backward_dw() before deleting a layer.",
                PendingWgradWarning,
                stacklevel=2,
            )

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, delay_wgrad_compute={self.delay_wgrad_compute}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, name={self.name!r}"
        )
