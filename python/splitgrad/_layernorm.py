"""splitgrad.LayerNormLinear and splitgrad.LayerNormMLP: te.LayerNormLinear's and te.LayerNormMLP's
delayed-wgrad API, composed of PyTorch's own differentiable norm (its gradients computed in the
backward, as TE does) and splitgrad's linear op (the GEMMs' weight gradients deferrable)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from . import _C
from ._errors import ArgumentError
from ._linear import (
    _TE_DEFAULTS,
    _autocast_enabled,
    _check_params_dtype,
    _check_sizes,
    _DeferredWgradModule,
    _factory,
    _refuse_fp8,
    _refuse_unsupported,
    _take_tensor_parallel_keywords,
    _reset_linear,
    _typed_errors,
)

__all__ = ["LayerNormLinear", "LayerNormMLP"]

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")

# te.LayerNormLinear / te.LayerNormMLP keywords for features splitgrad does not have, accepted at
# their defaults.
_TE_NORM_DEFAULTS = {
    **_TE_DEFAULTS,
    "return_layernorm_output_gathered": False,
    "ub_overlap_rs_dgrad": False,
    "ub_bulk_wgrad": False,
    "ub_bulk_dgrad": False,
    "symmetric_ar_type": None,
}
_TE_LAYERNORM_LINEAR_DEFAULTS = {**_TE_NORM_DEFAULTS, "parameters_split": None}
_TE_LAYERNORM_MLP_DEFAULTS = {
    **_TE_NORM_DEFAULTS,
    "activation_params": None,
    "seq_length": None,
    "micro_batch_size": None,
    "checkpoint": False,
}


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


# TE's activations: (function, gated). TE's "gelu" is the tanh approximation, "qgelu" the quick
# GELU x·sigmoid(1.702·x), "srelu" the squared ReLU. A gated one splits fc1's output [*, 2·ffn]
# into halves (a, b) and computes act(a) * b: TE gates the first half (PyTorch's F.glu gates the
# second; TE's "glu" is sigmoid(a) * b).
_ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (_gelu_tanh, False),
    "relu": (F.relu, False),
    "silu": (F.silu, False),
    "qgelu": (_quick_gelu, False),
    "srelu": (_squared_relu, False),
    "geglu": (_gelu_tanh, True),
    "reglu": (F.relu, True),
    "swiglu": (F.silu, True),
    "qgeglu": (_quick_gelu, True),
    "sreglu": (_squared_relu, True),
    "glu": (torch.sigmoid, True),
}


class _NormedModule(_DeferredWgradModule):
    """The norm both modules start with: ``layer_norm_weight`` (and ``layer_norm_bias`` for
    LayerNorm) over the input's last dimension, through F.layer_norm / F.rms_norm."""

    def _init_norm(self, module: str, hidden: int, eps: float, normalization: str, zero_centered_gamma: bool,
                   factory: dict) -> None:
        if normalization not in _NORMALIZATIONS:
            raise ArgumentError(
                f"splitgrad.{module}: expected normalization 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        self.eps = float(eps)
        self.normalization = normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden, **factory))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(hidden, **factory))
        else:
            self.register_parameter("layer_norm_bias", None)

    def _reset_norm(self) -> None:
        with torch.no_grad():
            # zero-centred gamma stores gamma - 1 (TE's): 0 is the identity scale
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()

    def _norm(self, inp: torch.Tensor, path: str, first_weight: torch.Tensor, gamma: torch.Tensor,
              beta: torch.Tensor | None, gemm: str = "") -> torch.Tensor:
        """The norm of ``inp`` by ``gamma`` and ``beta`` (layer_norm_weight and layer_norm_bias as
        this forward read them; beta None under RMSNorm)."""
        if path not in ("compile", "export"):
            # The input's checks, naming this module and its first GEMM (that GEMM's own checks,
            # before the norm runs).
            cast = _autocast_enabled(inp.device.type) and inp.is_floating_point()
            with _typed_errors():
                _C.check_gemm_args(self._layer_id, gemm, inp, first_weight, None, None, None, "weight", "bias",
                                   inp.dtype if cast else None)
        if not self.zero_centered_gamma:
            return self._normalize(inp, gamma, beta)
        if gamma.dtype not in (torch.bfloat16, torch.float16):
            return self._normalize(inp, gamma + 1, beta)
        # TE adds the 1 to a 16-bit gamma in fp32 inside its kernel (1 + gamma rounded to 16 bits
        # would lose gamma's low bits): the norm runs in fp32 and its output is rounded once. Under
        # autocast too: CPU autocast does not run layer_norm in fp32, and its mixed-dtype kernel's
        # gamma and beta gradients differ.
        gamma = gamma.float() + 1
        beta = beta.float() if beta is not None else None
        return self._normalize(inp.float(), gamma, beta).to(inp.dtype)

    def _normalize(self, inp: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
        shape = (gamma.shape[0],)
        if self.normalization == "LayerNorm":
            return F.layer_norm(inp, shape, gamma, beta, self.eps)
        return F.rms_norm(inp, shape, gamma, self.eps)


class LayerNormLinear(_NormedModule):
    """y = norm(x)·Wᵀ + b, whose weight and bias gradients can be deferred to :meth:`backward_dw`.

    Args (Transformer Engine's te.LayerNormLinear keywords):
        in_features, out_features: sizes of x's last dimension and of y's.
        eps: added to the variance in the norm.
        bias: whether the linear map has a bias.
        normalization: ``"LayerNorm"`` (``layer_norm_weight`` and ``layer_norm_bias``) or
            ``"RMSNorm"`` (``layer_norm_weight`` only).
        zero_centered_gamma: the norm scales by ``1 + layer_norm_weight`` (initialised to 0).
        return_layernorm_output: return ``(y, norm(x))``.
        return_bias: return ``norm(x)·Wᵀ`` and ``b`` and leave adding the bias to the caller.
        params_dtype, device, delay_wgrad_compute, fuse_wgrad_accumulation, init_method, name: as
            for :class:`splitgrad.Linear`. The norm's own gradients are computed in the backward
            (into ``.grad``, also with ``fuse_wgrad_accumulation``), as in TE.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | int | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        name: str | None = None,
        **te_keywords,
    ) -> None:
        super().__init__()
        self.__dict__.update(_take_tensor_parallel_keywords("LayerNormLinear", te_keywords))
        _refuse_unsupported("LayerNormLinear", te_keywords, _TE_LAYERNORM_LINEAR_DEFAULTS)
        in_features, out_features = _check_sizes("LayerNormLinear", in_features=in_features,
                                                 out_features=out_features)
        _check_params_dtype("LayerNormLinear", params_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        factory = _factory(device, params_dtype)
        self._init_norm("LayerNormLinear", in_features, eps, normalization, zero_centered_gamma, factory)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self._register(name)
        self._keep_init_methods(init_method=init_method)  # as TE: reset_parameters() after to_empty()
        self.reset_parameters()

    def _default_name(self, layer_id) -> str:
        return f"LayerNormLinear({self.in_features}, {self.out_features})#{layer_id}"

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """The norm's defaults; the weight by ``init_method``, else the one given at construction,
        with a zero bias (as TE), else both as nn.Linear."""
        self._reset_norm()
        with self._init_rng():
            _reset_linear(self.weight, self.bias, self._init_method("init_method", init_method))

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        """``norm(inp)·Wᵀ + b`` for ``inp`` of shape [*, in_features]; with
        return_layernorm_output, ``(out, norm(inp))``; with return_bias, ``(out, bias[, ln_out])``
        as te.LayerNormLinear returns them. ``is_first_microbatch`` does not change the gradients;
        ``fp8_output`` / ``fp8_grad`` (te.LayerNormLinear's) are accepted off."""
        _refuse_fp8(self.name, fp8_output, fp8_grad)
        self._check_forward_args(inp, is_first_microbatch)
        # Each parameter read once per forward, as nn.Linear does (a parametrization runs once).
        weight, bias, gamma, beta = self.weight, self.bias, self.layer_norm_weight, self.layer_norm_bias
        path = self._linear_path(inp, weight, bias, gamma, beta)
        ln_out = self._norm(inp, path, weight, gamma, beta)
        with _typed_errors():
            out = self._apply_linear(path, ln_out, weight, None if self.return_bias else bias)
        return _outputs(out, bias if self.return_bias else None, self.return_bias,
                        ln_out if self.return_layernorm_output else None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"normalization={self.normalization}, zero_centered_gamma={self.zero_centered_gamma}, "
            f"delay_wgrad_compute={self.delay_wgrad_compute}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, name={self.name!r}"
        )


class LayerNormMLP(_NormedModule):
    """y = fc2(act(fc1(norm(x)))), whose two GEMMs' weight and bias gradients can be deferred to
    :meth:`backward_dw` (one call runs one backward pass's work of both: fc2's, then fc1's).

    Args (Transformer Engine's te.LayerNormMLP keywords):
        hidden_size: size of x's last dimension and of y's.
        ffn_hidden_size: fc1's output size (twice that for a gated activation), fc2's input size.
        eps, bias, normalization, zero_centered_gamma, return_layernorm_output, params_dtype,
            device, delay_wgrad_compute, fuse_wgrad_accumulation, name: as for LayerNormLinear.
        activation: TE's names: ``"gelu"`` (the tanh approximation, as TE computes it), ``"relu"``,
            ``"silu"``, or the gated ``"geglu"``, ``"reglu"``, ``"swiglu"``: fc1's output is split
            into halves ``(a, b)`` and ``act(a) * b`` is fc2's input (TE gates the first half).
        return_bias: return ``(y without fc2's bias, fc2_bias)``.
        init_method, output_layer_init_method: called on fc1_weight / fc2_weight (default:
            nn.Linear's initialisation, as splitgrad.Linear's).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | int | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], object] | None = None,
        name: str | None = None,
        **te_keywords,
    ) -> None:
        super().__init__()
        self.__dict__.update(_take_tensor_parallel_keywords("LayerNormMLP", te_keywords))
        _refuse_unsupported("LayerNormMLP", te_keywords, _TE_LAYERNORM_MLP_DEFAULTS)
        hidden_size, ffn_hidden_size = _check_sizes("LayerNormMLP", hidden_size=hidden_size,
                                                    ffn_hidden_size=ffn_hidden_size)
        _check_params_dtype("LayerNormMLP", params_dtype)
        if activation not in _ACTIVATIONS:
            raise ArgumentError(
                f"splitgrad.LayerNormMLP: expected activation in {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        factory = _factory(device, params_dtype)
        self._init_norm("LayerNormMLP", hidden_size, eps, normalization, zero_centered_gamma, factory)
        fc1_out = 2 * ffn_hidden_size if _ACTIVATIONS[activation][1] else ffn_hidden_size
        # TE's order: fc1_weight, fc1_bias, fc2_weight, fc2_bias
        for prefix, shape in (("fc1", (fc1_out, hidden_size)), ("fc2", (hidden_size, ffn_hidden_size))):
            self.register_parameter(f"{prefix}_weight", nn.Parameter(torch.empty(shape, **factory)))
            self.register_parameter(f"{prefix}_bias", nn.Parameter(torch.empty(shape[0], **factory)) if bias else None)
        self._register(name)
        # as TE: reset_parameters() after to_empty()
        self._keep_init_methods(init_method=init_method, output_layer_init_method=output_layer_init_method)
        self.reset_parameters()

    def _deferred_parameter_names(self) -> list[str]:
        return ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]

    def _default_name(self, layer_id) -> str:
        return f"LayerNormMLP({self.hidden_size}, {self.ffn_hidden_size})#{layer_id}"

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None,
                         output_layer_init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """The norm's defaults; fc1_weight / fc2_weight by the methods given here, else by those
        given at construction, with a zero bias (as TE), else as nn.Linear."""
        self._reset_norm()
        with self._init_rng():
            _reset_linear(self.fc1_weight, self.fc1_bias, self._init_method("init_method", init_method))
            _reset_linear(self.fc2_weight, self.fc2_bias, self._init_method("output_layer_init_method", output_layer_init_method))

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """``fc2(act(fc1(norm(inp))))`` for ``inp`` of shape [*, hidden_size]; with
        return_layernorm_output, ``(out, norm(inp))``; with return_bias, ``(out, fc2_bias[,
        ln_out])`` as te.LayerNormMLP returns them."""
        self._check_forward_args(inp, is_first_microbatch)
        # Each parameter read once per forward, as nn.Linear does (a parametrization runs once).
        fc1_weight, fc1_bias, fc2_weight, fc2_bias_param = (self.fc1_weight, self.fc1_bias, self.fc2_weight,
                                                            self.fc2_bias)
        gamma, beta = self.layer_norm_weight, self.layer_norm_bias
        path = self._linear_path(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias_param, gamma, beta)
        ln_out = self._norm(inp, path, fc1_weight, gamma, beta, "fc1")
        with _typed_errors():
            fc1_out = self._apply_linear(path, ln_out, fc1_weight, fc1_bias, ("fc1_weight", "fc1_bias"), gemm="fc1")
            fc2_bias = None if self.return_bias else fc2_bias_param
            if path == "functional":  # torch.func differentiates the ATen composite (no C++ autograd there)
                act, gated = _ACTIVATIONS[self.activation]
                if gated:
                    gate, value = fc1_out.chunk(2, dim=-1)
                    hidden = act(gate) * value
                else:
                    hidden = act(fc1_out)
                out = self._apply_linear(path, hidden, fc2_weight, fc2_bias, ("fc2_weight", "fc2_bias"),
                                         gemm="fc2")
            else:
                # The activation inside fc2's op: its deferred wgrad keeps fc1's output (which the
                # backward holds anyway until the activation's backward) and recomputes the
                # activation in backward_dw(), instead of holding fc2's input until then.
                out = self._apply_linear(path, fc1_out, fc2_weight, fc2_bias, ("fc2_weight", "fc2_bias"),
                                         gemm="fc2", activation=self.activation)
        return _outputs(out, fc2_bias_param if self.return_bias else None, self.return_bias,
                        ln_out if self.return_layernorm_output else None)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"bias={self.fc1_bias is not None}, normalization={self.normalization}, "
            f"activation={self.activation}, zero_centered_gamma={self.zero_centered_gamma}, "
            f"delay_wgrad_compute={self.delay_wgrad_compute}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, name={self.name!r}"
        )


def _outputs(out, bias, return_bias: bool, ln_out):
    """TE's return convention: out, then the bias if return_bias, then ln_out if asked for."""
    result = (out, bias) if return_bias else (out,)
    if ln_out is not None:
        result += (ln_out,)
    return result if len(result) > 1 else out
