"""The registered operators (torch.ops.splitgrad.*) under torch.library.opcheck, and torch.compile."""

import pytest
import torch
from torch import nn
from torch.library import opcheck

import splitgrad
from sg_helpers import assert_grads_match, to_reference

ops = torch.ops.splitgrad

ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

# linear_fprop / linear_dgrad / linear_wgrad / linear_wgrad_accumulate_ are the non-differentiable
# GEMM building blocks that splitgrad::linear's autograd calls below the autograd key; they have no
# autograd kernel on purpose. Their inputs do not require grad, so the autograd sub-tests have
# nothing to check; they are all run anyway.
SHAPES = {"2d": (5,), "3d": (3, 5), "1d": ()}


def _tensors(lead, dtype=torch.float32):
    x = torch.randn(*lead, 8, dtype=dtype)
    w = torch.randn(4, 8, dtype=dtype)
    b = torch.randn(4, dtype=dtype)
    dy = torch.randn(*lead, 4, dtype=dtype)
    return x, w, b, dy


@pytest.mark.parametrize("lead", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_opcheck_linear_fprop(lead, bias):
    x, w, b, _ = _tensors(lead)
    opcheck(ops.linear_fprop.default, (x, w, b if bias else None), test_utils=ALL_TESTS)


@pytest.mark.parametrize("lead", list(SHAPES.values()), ids=list(SHAPES))
def test_opcheck_linear_dgrad(lead):
    _, w, _, dy = _tensors(lead)
    opcheck(ops.linear_dgrad.default, (dy, w), test_utils=ALL_TESTS)


@pytest.mark.parametrize("lead", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_opcheck_linear_wgrad(lead, bias):
    x, _, _, dy = _tensors(lead)
    opcheck(ops.linear_wgrad.default, (dy, x, bias), test_utils=ALL_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_opcheck_linear_wgrad_accumulate(dtype, bias):
    x, _, _, dy = _tensors((3, 5), dtype)
    weight_grad = torch.randn(4, 8)  # fp32 main_grad
    bias_grad = torch.randn(4) if bias else None
    opcheck(ops.linear_wgrad_accumulate_.default, (dy, x, weight_grad, bias_grad), test_utils=ALL_TESTS)


def test_wgrad_accumulate_adds():
    """linear_wgrad_accumulate_ is +=: the result equals the buffer plus linear_wgrad's."""
    x, _, _, dy = _tensors((3, 5))
    weight_grad, bias_grad = torch.randn(4, 8), torch.randn(4)
    expected_w = weight_grad + torch.mm(dy.reshape(-1, 4).t(), x.reshape(-1, 8))
    expected_b = bias_grad + dy.reshape(-1, 4).sum(0)
    ops.linear_wgrad_accumulate_(dy, x, weight_grad, bias_grad)
    torch.testing.assert_close(weight_grad, expected_w)
    torch.testing.assert_close(bias_grad, expected_b)


@pytest.mark.parametrize("lead", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_opcheck_linear(lead, fused):
    """The differentiable op, regular path (layer_id 0: no deferred-wgrad layer), all sub-tests."""
    x, w, b, _ = _tensors(lead)
    args = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), None, None, 0, False]
    if fused:
        args[3:5] = [torch.zeros(4, 8), torch.zeros(4)]
    opcheck(ops.linear.default, tuple(args), test_utils=ALL_TESTS)


def test_opcheck_linear_delayed():
    """The differentiable op with delay_wgrad_compute=True. test_aot_dispatch_dynamic does not
    apply: it traces the backward with FakeTensor/FunctionalTensor, and the delayed backward queues
    its stashed tensors for a later backward_dw(), which only works with real tensors
    (splitgrad.Linear keeps delayed calls out of torch.compile with torch.compiler.disable)."""
    layer = splitgrad.Linear(8, 4, device="cpu", delay_wgrad_compute=True)
    x, w, b, _ = _tensors((3, 5))
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), None, None, layer._layer_id, True)
    opcheck(ops.linear.default, args,
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert splitgrad.pending_wgrads() == 0  # none of those sub-tests runs a real backward


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------


def test_compile_fullgraph_forward():
    """A regular layer's forward compiles to one graph (no graph break) and matches nn.Linear."""
    layer = splitgrad.Linear(8, 4, device="cpu")
    reference = to_reference(layer)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x))
        torch.testing.assert_close(compiled(x[0]), reference(x[0]))


def test_compile_fullgraph_training_regular_layer():
    """A regular layer compiles to one graph with its backward (AOTAutograd traces the C++
    autograd function); gradients equal nn.Linear's."""
    model = nn.Sequential(splitgrad.Linear(8, 8, device="cpu"), nn.ReLU(), splitgrad.Linear(8, 4, device="cpu"))
    reference = to_reference(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, gy = torch.randn(5, 8), torch.randn(5, 4)
    compiled(x).backward(gy)
    reference(x).backward(gy)
    assert_grads_match(model, reference, exact=True)


def test_compile_graph_breaks_around_delayed_layer():
    """A delayed layer inside a compiled function runs eagerly (torch.compiler.disable: a graph
    break) and queues real tensors; its deferred gradients are exact. aot_eager runs the compiled
    parts with eager kernels, so the surrounding ops round as in the reference."""
    model = nn.Sequential(splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True),
                          nn.ReLU(),
                          splitgrad.Linear(8, 4, device="cpu", delay_wgrad_compute=True))
    reference = to_reference(model)

    def step(m, x, gy):
        return ((m(x * 2.0 + 1.0) * 3.0) * gy).sum()

    x, gy = torch.randn(5, 8), torch.randn(5, 4)
    explanation = torch._dynamo.explain(step)(model, x, gy)
    assert explanation.graph_break_count >= 1
    torch._dynamo.reset()

    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(2):  # the second call reuses the compiled graphs
        compiled(model, x, gy).backward()
        step(reference, x, gy).backward()
    assert splitgrad.pending_wgrads() == 4
    splitgrad.backward_dw_all()
    assert_grads_match(model, reference, exact=True)


def test_delayed_op_in_a_traced_backward_computes_at_once():
    """Called raw under AOTAutograd, the delayed op is traced by autograd.grad over its inputs,
    which writes no .grad: nothing is queued (no tracing placeholders), and the compiled backward
    computes the weight gradient at once, exactly as plain autograd."""
    layer = splitgrad.Linear(8, 8, bias=False, device="cpu", delay_wgrad_compute=True)
    weight = layer.weight.detach().clone().requires_grad_()

    def loss(x, w):
        return torch.ops.splitgrad.linear(x, w, None, None, None, layer._layer_id, True).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8, requires_grad=True)
    compiled(x, layer.weight).backward()
    assert splitgrad.pending_wgrads() == 0
    torch.nn.functional.linear(x, weight).sum().backward()
    torch.testing.assert_close(layer.weight.grad, weight.grad, rtol=0, atol=0)
