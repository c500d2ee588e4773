"""splitgrad's activation ops (torch.ops.splitgrad.activation / activation_backward) against the
ATen composite the modules used before, bit for bit, and the linear op's input_activation: its
gradients against plain autograd of act(x)·Wᵀ + b, immediate and deferred (fc2's deferred wgrad
keeps the activation's input and recomputes the activation in backward_dw())."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import splitgrad
from sg_helpers import ref_activation

ops = torch.ops.splitgrad
ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
ACTIVATIONS = ["gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu", "qgeglu", "sreglu", "glu"]
GATED = ("geglu", "reglu", "swiglu", "qgeglu", "sreglu", "glu")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
EXACT = dict(rtol=0, atol=0)


def _input(activation, dtype, lead=(3, 5), features=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = 2 * features if activation in GATED else features
    x = torch.randn(*lead, width, generator=generator) * 2
    x[..., 0] = 0.0  # relu's kink, gelu/silu at 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_equals_the_aten_composite(activation, dtype):
    for lead in [(7,), (3, 5), ()]:
        x = _input(activation, dtype, lead)
        got = ops.activation(x, activation)
        torch.testing.assert_close(got, ref_activation(activation, x), **EXACT)
        assert got.shape == (*lead, 6) and got.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_backward_equals_autograd_of_the_composite(activation, dtype):
    for lead in [(7,), (3, 5)]:
        x = _input(activation, dtype, lead).requires_grad_()
        dy = torch.randn(*lead, 6).to(dtype)
        ref_activation(activation, x).backward(dy)
        got = ops.activation_backward(dy, x.detach(), activation)
        torch.testing.assert_close(got, x.grad, **EXACT)
        assert got.shape == x.shape


def test_activation_errors_are_clear():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r'splitgrad::activation: expected activation "gelu", "relu", "silu", '
                                         r'"qgelu", "srelu", "geglu", "reglu", "swiglu", "qgeglu", "sreglu" '
                                         r'or "glu", got "tanh"'):
        ops.activation(x, "tanh")
    with pytest.raises(ValueError, match=r'gated activation "swiglu" expects an even last dimension.*\[4, 5\]'):
        ops.activation(torch.randn(4, 5), "swiglu")
    with pytest.raises(TypeError, match=r"expected a floating-point input.*torch.int64"):
        ops.activation(torch.ones(4, 6, dtype=torch.long), "relu")
    with pytest.raises(ValueError, match=r"splitgrad::activation_backward: expected grad_output of shape \[4, 3\]"):
        ops.activation_backward(torch.randn(4, 6), x, "geglu")
    with pytest.raises(TypeError, match=r"activation_backward: expected grad_output of dtype torch.float32"):
        ops.activation_backward(torch.randn(4, 6, dtype=torch.float64), x, "gelu")


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_opcheck_activation_ops(activation):
    for lead in [(5,), (3, 5)]:
        x = _input(activation, torch.float32, lead)
        opcheck(ops.activation.default, (x, activation), test_utils=ALL_TESTS)
        dy = torch.randn(*lead, 6)
        opcheck(ops.activation_backward.default, (dy, x, activation), test_utils=ALL_TESTS)


# linear with input_activation -------------------------------------------------------------------

def _layer_args(activation, dtype, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed + 1)
    h = _input(activation, dtype, (4, 5), seed=seed)
    w = (torch.randn(3, 6, generator=generator) * 0.5).to(dtype)
    b = torch.randn(3, generator=generator).to(dtype) if bias else None
    dy = torch.randn(4, 5, 3, generator=generator).to(dtype)
    return h, w, b, dy


def _reference(activation, h, w, b, dy):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = torch.nn.functional.linear(ref_activation(activation, h), w, b)
    y.backward(dy)
    return y, h.grad, w.grad, b.grad if b is not None else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mode", ["immediate", "delayed", "fused", "delayed-fused"])
def test_linear_with_input_activation_matches_plain_autograd(mode, activation, dtype):
    """act(h)·Wᵀ + b through the op: output, dh, dW, db equal plain autograd's bit for bit on the
    CPU, whether the wgrad runs at once, is deferred (the activation recomputed in backward_dw())
    or accumulated into an fp32 main_grad."""
    delay, fused = "delayed" in mode, "fused" in mode
    h, w, b, dy = _layer_args(activation, dtype)
    want_y, want_dh, want_dw, want_db = _reference(activation, h, w, b, dy)
    layer = splitgrad.Linear(6, 3, device="cpu", params_dtype=dtype, delay_wgrad_compute=delay)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    main = (torch.zeros(3, 6), torch.zeros(3)) if fused else (None, None)
    h = h.clone().requires_grad_()
    y = ops.linear(h, layer.weight, layer.bias, *main, layer._layer_id, delay, activation)
    torch.testing.assert_close(y, want_y, **EXACT)
    y.backward(dy)
    torch.testing.assert_close(h.grad, want_dh, **EXACT)
    assert splitgrad.pending_wgrads() == (1 if delay else 0)
    layer.backward_dw()
    if fused:
        # the fp32 sums of the products (linear_wgrad_accumulate_'s contract)
        want_dw = torch.mm(dy.reshape(-1, 3).t().float(), ref_activation(activation, h.detach()).reshape(-1, 6).float())
        torch.testing.assert_close(main[0], want_dw, **EXACT)
        torch.testing.assert_close(main[1], dy.reshape(-1, 3).float().sum(0), **EXACT)
        assert layer.weight.grad is None
    else:
        torch.testing.assert_close(layer.weight.grad, want_dw, **EXACT)
        torch.testing.assert_close(layer.bias.grad, want_db, **EXACT)


def test_delayed_item_keeps_the_activation_input_and_recomputes():
    """The deferred item holds h (not act(h)): act(h) is gone after the backward, and recomputed in
    backward_dw() with the same gradient as immediate mode."""
    h, w, _, dy = _layer_args("swiglu", torch.float32, bias=False)
    layer = splitgrad.Linear(6, 3, bias=False, device="cpu", delay_wgrad_compute=True)
    with torch.no_grad():
        layer.weight.copy_(w)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.linear(h, layer.weight, None, None, None, layer._layer_id, True, "swiglu")
    assert [t.shape[-1] for t in saved] == [12, 6]  # h and the weight: act(h) is not saved
    y.backward(dy)
    layer.backward_dw()
    torch.testing.assert_close(layer.weight.grad, _reference("swiglu", h, w, None, dy)[2], **EXACT)


def test_stashed_activation_input_modified_in_place_is_a_clear_error():
    layer = splitgrad.Linear(6, 3, device="cpu", delay_wgrad_compute=True, name="fc2")
    h = _input("geglu", torch.float32)
    ops.linear(h, layer.weight, layer.bias, None, None, layer._layer_id, True, "geglu").sum().backward()
    h.add_(1.0)  # the stashed activation input
    with pytest.raises(RuntimeError, match=r"'fc2': the input of its activation \"geglu\" \(in a LayerNormMLP: "
                                           r"fc2's, fc1's output\) stashed for its deferred weight gradient was "
                                           r"modified"):
        layer.backward_dw()
    assert layer.weight.grad is None and splitgrad.pending_wgrads() == 0


def test_linear_input_activation_errors():
    layer = splitgrad.Linear(6, 3, device="cpu", name="fc2")
    with pytest.raises(ValueError, match=r"'fc2': expected activation .* got \"gelu2\""):
        ops.linear(torch.randn(4, 6), layer.weight, None, None, None, layer._layer_id, False, "gelu2")
    # the message is about the tensor passed (fc1's output), not the activation's output
    with pytest.raises(ValueError, match=r"'fc2': expected input of shape \[\*, 12\] for activation \"swiglu\" "
                                         r"before in_features = 6 \(a gated activation halves its input\), "
                                         r"got shape \[4, 6\]"):
        ops.linear(torch.randn(4, 6), layer.weight, None, None, None, layer._layer_id, False, "swiglu")
    with pytest.raises(ValueError, match=r"'fc2': expected input of shape \[\*, 6\] for activation \"gelu\" "
                                         r"before in_features = 6, got shape \[4, 5\]"):
        ops.linear(torch.randn(4, 5), layer.weight, None, None, None, layer._layer_id, False, "gelu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_ops_called_under_autograd_get_the_composites_gradients(activation):
    """The ops have no derivative of their own; where autograd must differentiate them they run the
    composite's differentiable ops, so a user's graph gets plain autograd's gradients, not none."""
    x = _input(activation, torch.float64, (5,)).requires_grad_()
    dy = torch.randn(5, 6, dtype=torch.float64)
    ops.activation(x, activation).backward(dy)
    xr = x.detach().clone().requires_grad_()
    ref_activation(activation, xr).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    # activation_backward under autograd (a double backward): its gradient is the composite's
    g = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    xd = x.detach().clone().requires_grad_()
    ops.activation_backward(g, xd, activation).sum().backward()
    gr, xdr = g.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    (first,) = torch.autograd.grad(ref_activation(activation, xdr), xdr, gr, create_graph=True)
    first.sum().backward()
    torch.testing.assert_close(g.grad, gr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(xd.grad, xdr.grad, rtol=0, atol=1e-12)
    with torch.no_grad():  # no graph wanted: the kernels
        torch.testing.assert_close(ops.activation(x, activation), ref_activation(activation, x.detach()), **EXACT)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_double_backward_with_input_activation(activation):
    """backward(create_graph=True) through the op with an activation: the gradients are
    differentiable, and their own gradients match plain autograd's."""
    h, w, b, dy = _layer_args(activation, torch.float64)
    grads = []
    for use_op in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if use_op:
            y = ops.linear(hh, ww, b, None, None, 0, False, activation)
        else:
            y = torch.nn.functional.linear(ref_activation(activation, hh), ww, b)
        dh, dw = torch.autograd.grad((y * dy).sum(), (hh, ww), create_graph=True)
        grads.append((dh, dw, *torch.autograd.grad(dh.square().sum() + dw.sum(), (hh, ww))))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation", ["relu", "geglu"])
def test_opcheck_linear_with_input_activation(activation):
    h, w, b, _ = _layer_args(activation, torch.float32)
    args = (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), None, None, 0, False, activation)
    opcheck(ops.linear.default, args, test_utils=ALL_TESTS)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_autocast_with_input_activation(activation):
    """Under autocast the activation runs on the cast input, as act(h) of the composite would."""
    h, w, b, dy = _layer_args(activation, torch.float32)
    layer = splitgrad.Linear(6, 3, device="cpu", delay_wgrad_compute=True)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    hb = h.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.linear(hb, layer.weight, layer.bias, None, None, layer._layer_id, True, activation)
        want = torch.nn.functional.linear(ref_activation(activation, hb.detach()), w, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, **EXACT)
    y.backward(dy.to(torch.bfloat16))
    layer.backward_dw()
    assert layer.weight.grad.dtype == torch.float32
