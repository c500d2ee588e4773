"""splitgrad.GroupedLinear: MoE experts over one tensor's rows, te.GroupedLinear's API, with
deferred weight gradients that equal per-expert plain autograd's."""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
from torch import nn

from . import _C
from ._errors import ArgumentError, DTypeError
from ._linear import (
    _TE_DEFAULTS,
    _autocast_enabled,
    _check_params_dtype,
    _check_sizes,
    _DeferredWgradModule,
    _factory,
    _base_of,
    _refuse_unsupported,
    _reset_linear,
    _take_tensor_parallel_keywords,
    _typed_errors,
)

__all__ = ["GroupedLinear"]

# te.GroupedLinear's keywords accepted at their defaults: te.Linear's, and these.
_GROUPED_TE_DEFAULTS = {
    **_TE_DEFAULTS,
    "save_original_input": False,
    "single_grouped_weight": False,
    "single_grouped_bias": False,
    "use_grouped_tensor": None,
}

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_grouped_linear_op = torch.ops.splitgrad.grouped_linear.default


@torch.compiler.disable(
    reason="a splitgrad.GroupedLinear with delay_wgrad_compute or fuse_wgrad_accumulation runs "
    "eagerly (a graph break): its deferred work and main_grad accumulation happen outside compiled "
    "graphs")
def _grouped_outside_graph(module, inp, splits, weights, biases):
    # with the main_grad checks (Python attributes: traced, they recompiled per expert)
    module._check_main_grads(weights, biases)
    return _grouped_linear_op(inp, splits, weights, biases, [], [], module._layer_id, module.delay_wgrad_compute,
                              module.fuse_wgrad_accumulation)


def _is_array(value) -> bool:
    """A numpy array (or another array type with a dtype), told without importing numpy."""
    return hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "tolist")


class GroupedLinear(_DeferredWgradModule):
    """``num_gemms`` linear maps (MoE experts) over one tensor's rows: rows
    ``[offset_i, offset_i + m_splits[i])`` of the input go through expert ``i``,
    ``y_i = x_i·W_iᵀ + b_i``, whose weight and bias gradients can be deferred to :meth:`backward_dw`.

    Args (Transformer Engine's te.GroupedLinear keywords):
        num_gemms: number of experts.
        in_features, out_features: sizes of x's last dimension and of y's.
        bias: whether every expert has a bias.
        return_bias: return ``(y without the biases, [bias0, ...])`` and leave adding each
            expert's bias to its rows to the caller (te.GroupedLinear's; ``[None, ...]`` without bias).
        params_dtype, device, delay_wgrad_compute, fuse_wgrad_accumulation, init_method, name: as
            for :class:`splitgrad.Linear`, per expert (``init_method`` is called on each weight).

    Parameters ``weight0`` … ``weight{n-1}`` and ``bias0`` … are parameters of their own: tie them by
    assignment (``layer.weight1 = layer.weight0``, ``layer.weight0 = other.weight``), give each its
    ``main_grad``; every contribution to a shared parameter accumulates. One application queues one
    deferred item (all experts), run by one ``backward_dw()``.
    """

    _jit_traceable = False  # see _DeferredWgradModule

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
        return_bias: bool = False,
        name: str | None = None,
        **te_keywords,
    ) -> None:
        super().__init__()
        self.__dict__.update(_take_tensor_parallel_keywords("GroupedLinear", te_keywords))
        _refuse_unsupported("GroupedLinear", te_keywords, _GROUPED_TE_DEFAULTS)
        num_gemms, in_features, out_features = _check_sizes(
            "GroupedLinear", num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        _check_params_dtype("GroupedLinear", params_dtype)
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = bool(return_bias)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        factory = _factory(device, params_dtype)
        for i in range(num_gemms):  # te.GroupedLinear's order: weight0, bias0, weight1, ...
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features, **factory)))
            # without bias, bias{i} is None (nn.Linear's way): getattr works, no parameter is listed
            self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, **factory)) if bias else None)
        self._register(name)
        self._keep_init_methods(init_method=init_method)  # as TE: reset_parameters() after to_empty()
        self.reset_parameters()

    def _deferred_parameter_names(self) -> list[str]:
        return [f"{kind}{i}" for kind in ("weight", "bias") for i in range(self.num_gemms)]

    def _default_name(self, layer_id) -> str:
        return f"GroupedLinear({self.num_gemms}, {self.in_features}, {self.out_features})#{layer_id}"

    @property
    def weights(self) -> list[nn.Parameter]:
        """weight0 … weight{n-1}, as the module holds them now (after any tying)."""
        # getattr's default: a deleted parameter reads as None (an AttributeError raised in a property
        # would be reported by nn.Module as the property itself missing)
        weights = [getattr(self, f"weight{i}", None) for i in range(self.num_gemms)]
        for i, weight in enumerate(weights):
            if not isinstance(weight, torch.Tensor):
                raise ArgumentError(f"splitgrad layer '{self.name}': expected weight{i} to be a tensor of shape "
                                    f"[{self.out_features}, {self.in_features}], got {type(weight).__name__}")
        return weights

    @property
    def biases(self) -> list[nn.Parameter]:
        """bias0 … bias{n-1} as the module holds them now, or [] where none is set (bias=False, as
        nn.Linear's bias: biases assigned later are used). Every expert has a bias, or none has."""
        biases = [getattr(self, f"bias{i}", None) for i in range(self.num_gemms)]
        missing = [i for i, bias in enumerate(biases) if bias is None]
        if len(missing) == len(biases):
            return []
        if missing:
            present = next(i for i, bias in enumerate(biases) if bias is not None)
            raise ArgumentError(f"splitgrad layer '{self.name}': expected a bias for every expert or for none, got "
                                f"bias{missing[0]} = None and bias{present} set ({len(missing)} of "
                                f"{self.num_gemms} missing)")
        return biases

    @property
    def use_bias(self) -> bool:
        """Whether the experts have biases now (te.GroupedLinear's attribute)."""
        return any(getattr(self, f"bias{i}", None) is not None for i in range(self.num_gemms))

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """Each expert as nn.Linear (or ``init_method(weight_i)`` and a zero bias, as TE; by default
        the method given at construction), expert by expert."""
        biases = self.biases or [None] * self.num_gemms
        with self._init_rng():
            for weight, bias in zip(self.weights, biases):
                _reset_linear(weight, bias, self._init_method("init_method", init_method))

    def _splits_tensor(self, m_splits) -> torch.Tensor:
        """m_splits as the op takes it: an int64 tensor. A list of ints or an integer numpy array
        becomes a CPU tensor; a tensor stays on its device (another integer dtype is converted
        there, without a host synchronisation), and so does a list of 0-d integer tensors (stacked
        where they are, not read). Counts, signs, sums and devices are checked by the op, which
        names this layer."""
        who = f"splitgrad layer '{self.name}'"
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dtype == torch.bool or m_splits.is_floating_point() or m_splits.is_complex():
                raise DTypeError(f"{who}: expected m_splits of an integer dtype (row counts), got {m_splits.dtype}")
            return m_splits if m_splits.dtype == torch.int64 else m_splits.to(torch.int64)
        if _is_array(m_splits):  # numpy's (np.bincount's counts): host values, read as ints below
            if getattr(m_splits.dtype, "kind", None) not in ("i", "u"):
                raise DTypeError(f"{who}: expected m_splits of an integer dtype (row counts), got {m_splits.dtype}")
            m_splits = m_splits.tolist()
        if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
            raise TypeError(f"{who}: expected m_splits as a list of ints or an integer tensor, got {type(m_splits).__name__}")
        if m_splits and all(isinstance(s, torch.Tensor) for s in m_splits):
            return self._stack_splits(m_splits, who)
        counts = []
        for i, s in enumerate(m_splits):
            if torch.compiler.is_compiling() and isinstance(s, int) and not isinstance(s, bool):
                counts.append(s)  # maybe traced (counts.tolist()), not to be read here: the op checks it
                continue
            try:  # ints, and integers that say they are (numpy's): not floats, not bools (numpy's
                # refuse operator.index)
                if isinstance(s, (bool, torch.Tensor)):
                    raise TypeError
                counts.append(operator.index(s))
            except TypeError:
                hint = " (a list of tensors must hold only 0-d integer tensors)" if isinstance(s, torch.Tensor) else ""
                raise DTypeError(f"{who}: expected m_splits of ints (row counts), got m_splits[{i}] = {s!r}{hint}") from None
            if not _INT64_MIN <= counts[-1] <= _INT64_MAX:
                raise ArgumentError(f"{who}: expected m_splits of row counts that fit in int64, got m_splits[{i}] = {s!r}")
        return torch.tensor(counts, dtype=torch.int64, device="cpu")

    @staticmethod
    def _stack_splits(m_splits, who: str) -> torch.Tensor:
        """A list of 0-d integer tensors (``list(counts)``, ``counts.unbind()``) as one int64 tensor on
        their device, without reading them on the host."""
        for i, s in enumerate(m_splits):
            if s.dim() != 0 or s.dtype == torch.bool or s.is_floating_point() or s.is_complex():
                raise DTypeError(f"{who}: expected m_splits as 0-d integer tensors (row counts), got m_splits[{i}] "
                                 f"of shape {list(s.shape)} and dtype {s.dtype}")
        devices = {s.device for s in m_splits}
        if len(devices) > 1:
            raise ArgumentError(f"{who}: expected m_splits tensors on one device, got {sorted(map(str, devices))}")
        return torch.stack([s.to(torch.int64) for s in m_splits])

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: bool | None = None):
        """y = per-expert ``x_i·W_iᵀ + b_i`` for ``inp`` of shape [*, in_features] (flattened to
        [tokens, in_features]); ``m_splits``: rows per expert, a list of ints, an integer numpy array
        or an integer tensor (CPU, or the input's device: passed on without a host synchronisation),
        or a list of 0-d integer tensors. With return_bias, ``(y without the biases, [bias0, ...])``
        as te.GroupedLinear returns them.

        ``is_first_microbatch`` is accepted for te.GroupedLinear compatibility; it does not change the
        gradients (they accumulate over micro-batches either way).
        """
        self._check_forward_args(inp, is_first_microbatch)
        splits = self._splits_tensor(m_splits)
        weights, biases = self.weights, self.biases
        # return_bias (te.GroupedLinear): the caller adds the biases, so autograd owns their gradients.
        out = self._grouped(inp, splits, weights, [] if self.return_bias else biases)
        if self.return_bias:
            return out, biases or [None] * self.num_gemms
        return out

    def _grouped(self, inp, splits, weights, biases) -> torch.Tensor:
        path = self._linear_path(inp, *weights, *biases)
        if path == "trace":
            raise TypeError(f"splitgrad layer '{self.name}' cannot be recorded by torch.jit.trace (its op takes "
                            "lists of optional tensors, which the tracer does not record); use torch.export or "
                            "torch.compile")
        if path == "functional":
            self._layer.note_ran_untracked()  # its backward will not name this layer
            return self._functional(inp, splits, weights, biases)
        fused = self.fuse_wgrad_accumulation
        with _typed_errors():
            if path == "compile" and (self.delay_wgrad_compute or fused):
                return _grouped_outside_graph(self, inp, splits, weights, biases)
            if fused and path != "export":  # checked here; the backward reads them (see _apply_linear)
                self._check_main_grads(weights, biases)
            if path == "export":
                # A graph meant to outlive this process records a regular, unfused call (layer 0).
                return _grouped_linear_op(inp, splits, weights, biases, [], [], 0, False)
            if path == "op":
                self._note_if_captured(inp)
            return _grouped_linear_op(inp, splits, weights, biases, [], [], self._layer_id,
                                      self.delay_wgrad_compute, fused)

    def _check_main_grads(self, weights, biases) -> None:
        if self.fuse_wgrad_accumulation:
            for i, w in enumerate(weights):
                self._main_grad_of(w, f"weight{i}")
            for i, b in enumerate(biases):
                self._main_grad_of(b, f"bias{i}", required=False)

    def _functional(self, inp, splits, weights, biases):
        # Under a torch.func transform or forward-mode AD: each expert with F.linear, as a plain
        # per-expert model computes it (PyTorch runs no C++ autograd Function there). The splits
        # are read on the host (transforms run eagerly), then the op's checks run, naming this
        # layer (autocast casts a floating input to its dtype before the products).
        counts = [int(c) for c in splits.tolist()]
        cast = _autocast_enabled(inp.device.type) and inp.is_floating_point()
        with _typed_errors():
            _C.check_grouped_linear_args(self._layer_id, inp, splits, counts, weights, biases,
                                         inp.dtype if cast else None)
        rows = inp.flatten(0, -2) if inp.dim() > 1 else inp.unsqueeze(0)  # in_features may be 0 here
        trained = [w for w in weights if _base_of(w).requires_grad]
        if trained:  # one warning for the layer
            self._warn_if_fused_functional(trained[0], "each expert's weight{i}")
        pieces = rows.split(counts)
        outs = [nn.functional.linear(x, w, biases[i] if biases else None)
                for i, (x, w) in enumerate(zip(pieces, weights))]
        return torch.cat(outs).reshape(*inp.shape[:-1], weights[0].shape[0])

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, return_bias={self.return_bias}, delay_wgrad_compute={self.delay_wgrad_compute}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, name={self.name!r}"
        )
