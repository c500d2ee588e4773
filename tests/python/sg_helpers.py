"""Shared helpers for the Python suite: the plain-autograd reference, and the one way to compare
gradients with it.

The reference for a splitgrad model is the same model in plain PyTorch autograd (``to_reference``):
every ``splitgrad.Linear`` becomes an ``nn.Linear`` (a LayerNormLinear / LayerNormMLP the same
norm, F.linear and activation in plain PyTorch) holding a copy of the same parameters, with the
same tying, the same pre-existing gradients, and the same surrounding modules (embeddings, containers).
Tests run the same forward/backward steps on both and compare every parameter's gradient with
``assert_grads_match``.
"""

from __future__ import annotations

import copy
import re
from typing import Callable, Sequence

import pytest
import torch
from torch import nn

import splitgrad

NO_CUDA = "CUDA is not available on this machine (the CPU run covers the contract)"

#: Devices to parametrize over: the CPU always, CUDA when there is one.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)),
]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class RefLinear(nn.Linear):
    """splitgrad.Linear's plain-autograd twin: nn.Linear (F.linear), accepting ``is_first_microbatch``
    as te.Linear does (it does not change the result)."""

    def forward(self, x, is_first_microbatch=None):  # noqa: D401
        return super().forward(x)


def _ref_norm(module, x):
    """The norm of a LayerNormLinear / LayerNormMLP, as plain PyTorch computes it (nn.LayerNorm's
    and nn.RMSNorm's functional forms); zero-centred gamma scales by 1 + weight, with the 1 added
    in fp32 as TE's kernels add it: a 16-bit module's norm runs in fp32, its output rounded once."""
    gamma, beta, dtype = module.layer_norm_weight, module.layer_norm_bias, x.dtype
    in_fp32 = module.zero_centered_gamma and gamma.dtype in LOW_PRECISION
    if in_fp32:
        x, gamma, beta = x.float(), gamma.float(), beta.float() if beta is not None else None
    if module.zero_centered_gamma:
        gamma = gamma + 1
    if module.normalization == "LayerNorm":
        out = nn.functional.layer_norm(x, gamma.shape, gamma, beta, module.eps)
    else:
        out = nn.functional.rms_norm(x, gamma.shape, gamma, module.eps)
    return out.to(dtype) if in_fp32 else out


def _ref_outputs(module, out, bias, ln_out):
    result = (out, bias) if module.return_bias else (out,)
    if module.return_layernorm_output:
        result += (ln_out,)
    return result if len(result) > 1 else out


class RefLayerNormLinear(nn.Module):
    """splitgrad.LayerNormLinear's plain-autograd twin (same parameter names): F.layer_norm /
    F.rms_norm, then F.linear."""

    def __init__(self, module: "splitgrad.LayerNormLinear", memo: dict) -> None:
        super().__init__()
        for attr in ("eps", "normalization", "zero_centered_gamma", "return_layernorm_output", "return_bias"):
            setattr(self, attr, getattr(module, attr))
        for name, param in module._parameters.items():
            setattr(self, name, memo[id(param)] if param is not None else None)

    def forward(self, x, is_first_microbatch=None):
        ln_out = _ref_norm(self, x)
        out = nn.functional.linear(ln_out, self.weight, None if self.return_bias else self.bias)
        return _ref_outputs(self, out, self.bias, ln_out)


def ref_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """TE's activations in plain PyTorch: gelu is the tanh approximation; gated ones act on the
    first half and multiply by the second."""
    fns = {"gelu": lambda t: nn.functional.gelu(t, approximate="tanh"), "relu": torch.relu,
           "silu": nn.functional.silu, "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
           "srelu": lambda t: torch.relu(t).square(), "sigmoid": torch.sigmoid}
    gated = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu", "qgeglu": "qgelu", "sreglu": "srelu",
             "glu": "sigmoid"}
    if name in gated:
        a, b = x.chunk(2, dim=-1)
        return fns[gated[name]](a) * b
    return fns[name](x)


class RefLayerNormMLP(nn.Module):
    """splitgrad.LayerNormMLP's plain-autograd twin (same parameter names)."""

    def __init__(self, module: "splitgrad.LayerNormMLP", memo: dict) -> None:
        super().__init__()
        for attr in ("eps", "normalization", "zero_centered_gamma", "return_layernorm_output", "return_bias",
                     "activation"):
            setattr(self, attr, getattr(module, attr))
        for name, param in module._parameters.items():
            setattr(self, name, memo[id(param)] if param is not None else None)

    def forward(self, x, is_first_microbatch=None):
        ln_out = _ref_norm(self, x)
        hidden = ref_activation(self.activation, nn.functional.linear(ln_out, self.fc1_weight, self.fc1_bias))
        out = nn.functional.linear(hidden, self.fc2_weight, None if self.return_bias else self.fc2_bias)
        return _ref_outputs(self, out, self.fc2_bias, ln_out)


#: splitgrad's modules with deferrable weight gradients.
SPLITGRAD_MODULES = (splitgrad.Linear, splitgrad.LayerNormLinear, splitgrad.LayerNormMLP)
class RefGroupedLinear(nn.Module):
    """splitgrad.GroupedLinear's plain-autograd twin: one F.linear (nn.Linear's op) per expert on
    its rows, concatenated. Parameters weight0.., bias0.. are set by ``to_reference``."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features

    def forward(self, x, m_splits, is_first_microbatch=None):  # noqa: D401
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        rows = x.reshape(-1, self.in_features).split(splits)
        outs = [torch.nn.functional.linear(r, getattr(self, f"weight{i}"), getattr(self, f"bias{i}", None))
                for i, r in enumerate(rows)]
        return torch.cat(outs).reshape(*x.shape[:-1], self.out_features)


def _twin_parameter(param: torch.Tensor, dtype: torch.dtype | None) -> nn.Parameter:
    """A fresh parameter with ``param``'s values (in ``dtype``), whose ``.grad`` starts where
    ``param``'s gradient starts: its ``main_grad`` if it has one (fuse_wgrad_accumulation), else
    its ``.grad``."""
    dtype = dtype or param.dtype
    twin = nn.Parameter(param.detach().to(dtype, copy=True), requires_grad=param.requires_grad)
    start = getattr(param, "main_grad", None)
    if start is None:
        start = param.grad
    if start is not None:
        twin.grad = start.detach().to(dtype, copy=True)
    return twin


def unwritable_grad(param: torch.Tensor, how: str) -> torch.Tensor:
    """A .grad for ``param`` that an in-place add fails on: made under inference mode
    (``how="inference"``), or expanded from one element (``"expanded"``: its elements share memory)."""
    if how == "inference":
        with torch.inference_mode():
            return torch.zeros_like(param)
    return torch.zeros(1).expand(param.shape)


def to_reference(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The same model in plain PyTorch autograd, optionally in another dtype (e.g. float64 as a
    high-precision reference). Tying is kept: a parameter shared by several modules is one
    parameter in the copy too."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in memo:
                memo[id(param)] = _twin_parameter(param, dtype)
    for module in model.modules():
        if isinstance(module, splitgrad.Linear):
            ref = RefLinear(module.in_features, module.out_features, bias=module.bias is not None,
                            device="meta")
            ref.weight = memo[id(module.weight)]
            if module.bias is not None:
                ref.bias = memo[id(module.bias)]
            memo[id(module)] = ref
        elif isinstance(module, splitgrad.LayerNormLinear):
            memo[id(module)] = RefLayerNormLinear(module, memo)
        elif isinstance(module, splitgrad.LayerNormMLP):
            memo[id(module)] = RefLayerNormMLP(module, memo)
        elif isinstance(module, splitgrad.GroupedLinear):
            ref = RefGroupedLinear(module.num_gemms, module.in_features, module.out_features)
            biases = module.biases or [None] * module.num_gemms
            for i, (weight, bias) in enumerate(zip(module.weights, biases)):  # the module's order
                setattr(ref, f"weight{i}", memo[id(weight)])
                if bias is not None:
                    setattr(ref, f"bias{i}", memo[id(bias)])
            memo[id(module)] = ref
    reference = copy.deepcopy(model, memo)
    if dtype is not None:
        reference.to(dtype)  # buffers; the parameters are already in dtype
    return reference


def backward_under_compiled_autograd(how: str, backward: Callable[[], None]) -> None:
    """Runs ``backward`` (a forward and its backward) under compiled autograd: ``how`` "config" as
    torchtitan enables it (dynamo's compiled_autograd flag, the step compiled), "context" with the
    context manager around an eager step."""
    torch._dynamo.reset()
    if how == "config":
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(backward, backend="aot_eager")()
    elif how == "context":
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            backward()
    else:
        raise ValueError(f"how: expected 'config' or 'context', got {how!r}")


def gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """Where a parameter's gradient lives: ``main_grad`` if the caller gave it one
    (fuse_wgrad_accumulation), else ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def named_gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: gradient_of(p) for name, p in model.named_parameters()}


def assert_within_torch_error(name, actual, reference, high, dtype, factor=2.0):
    """flash-attention's criterion: splitgrad's error against a high-precision reference is at most
    ``factor`` times PyTorch's own error in ``dtype`` on the same computation, plus a couple of
    rounding steps of the result's magnitude (for when PyTorch's error happens to be 0). Empty
    tensors agree."""
    assert actual.shape == high.shape == reference.shape, f"{name}: shapes differ"
    if actual.numel() == 0:
        return
    high = high.double()
    err = (actual.double() - high).abs().max().item()
    err_torch = (reference.double() - high).abs().max().item()
    floor = 2 * torch.finfo(dtype).eps * high.abs().max().item()
    assert err <= factor * err_torch + floor, (
        f"{name}: max error against the float64 reference is {err:.3g}; PyTorch's own {dtype} error "
        f"is {err_torch:.3g} (allowed: {factor} x that + {floor:.3g})"
    )


def assert_grads_match(model: nn.Module, reference: nn.Module, *, exact: bool,
                       high_precision: nn.Module | None = None, factor: float = 2.0) -> None:
    """Asserts that every parameter gradient of ``model`` equals ``reference``'s (plain autograd).

    - ``exact=True``: bit for bit (float32 on the CPU, contributions summed in the same order).
    - float32/float64 otherwise: assert_close's dtype tolerances, with ``atol`` scaled by the
      gradient's magnitude (the sums differ only in their order).
    - bfloat16/float16 parameters: ``high_precision`` (the reference run in float64) is required;
      splitgrad's error against it must stay within ``factor`` x PyTorch's own error.
    A gradient that is None on one side must be None on the other.
    """
    actual = named_gradients(model)
    expected = named_gradients(reference)
    assert list(actual) == list(expected), f"parameters differ: {list(actual)} vs {list(expected)}"
    params = dict(model.named_parameters())
    high = named_gradients(high_precision) if high_precision is not None else None
    for name, got in actual.items():
        want = expected[name]
        if got is None or want is None:
            assert got is None and want is None, (
                f"{name}: gradient is {'None' if got is None else 'set'} but the reference's is "
                f"{'None' if want is None else 'set'}"
            )
            continue
        dtype = params[name].dtype
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        if exact:
            assert dtype not in LOW_PRECISION, "exact comparisons are for float32/float64"
            torch.testing.assert_close(got, want, rtol=0, atol=0,
                                       msg=lambda m: f"{name} (expected bit-identical): {m}")
        elif dtype in LOW_PRECISION:
            assert high is not None, f"{name}: a {dtype} comparison needs a float64 reference"
            assert_within_torch_error(name, got, want, high[name], dtype, factor)
        else:
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(got, want.to(got.dtype), rtol=1.3e-6, atol=1e-5 * scale,
                                       msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------------
# Running forward / backward / backward_dw schedules
# --------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"^(F|B|W)(\d*)$|^Wall$")


def run_schedule(schedule: str | Sequence[str], model: nn.Module, inputs: Sequence[torch.Tensor],
                 grad_outputs: Sequence[torch.Tensor], *, w_step: Callable[[str], None] | None = None,
                 forward: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] | None = None) -> None:
    """Runs a micro-batch schedule such as ``"F0 F1 B0 B1 W0 W1"`` on ``model``.

    ``F<i>``: forward of micro-batch i (``forward(model, inputs[i], i)``, default ``model(x)``);
    ``B<i>``: its backward with ``grad_outputs[i]``; ``W<i>`` / ``Wall``: ``w_step(token)``, the
    deferred work (nothing for a plain-autograd reference, where ``w_step`` is None).
    """
    tokens = schedule.split() if isinstance(schedule, str) else list(schedule)
    forward = forward or (lambda m, x, i: m(x))
    outputs: dict[int, torch.Tensor] = {}
    for token in tokens:
        match = _TOKEN.match(token)
        assert match, f"bad schedule token {token!r}"
        kind = token[0]
        if kind == "F":
            i = int(match.group(2))
            outputs[i] = forward(model, inputs[i], i)
        elif kind == "B":
            i = int(match.group(2))
            outputs.pop(i).backward(grad_outputs[i])
        elif w_step is not None:
            w_step(token)
    assert not outputs, f"schedule {tokens} leaves forwards without a backward: {sorted(outputs)}"


def delayed_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, SPLITGRAD_MODULES) and m.delay_wgrad_compute]


def backward_dw_each(model: nn.Module) -> None:
    """One W step: backward_dw() on every delayed layer of ``model`` that has work pending."""
    for layer in delayed_layers(model):
        if layer.pending_wgrads():
            layer.backward_dw()


def make_data(n: int, shape: Sequence[int], out_features: int, *, dtype=torch.float32, device="cpu",
              generator: torch.Generator | None = None):
    """n micro-batches of inputs [*shape] and grad_outputs [*shape[:-1], out_features]. Values are
    drawn in float32 and cast, so a float64 copy (``.double()``) holds exactly the same numbers."""
    xs = [torch.randn(*shape, generator=generator).to(dtype=dtype, device=device) for _ in range(n)]
    gys = [torch.randn(*shape[:-1], out_features, generator=generator).to(dtype=dtype, device=device)
           for _ in range(n)]
    return xs, gys


def as_dtype(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to(dtype) for t in tensors]
