"""SPEC §1: deferred gradients equal plain autograd's, one focused test per bullet.

Each test builds a splitgrad model, its plain-autograd twin (``to_reference``: nn.Linear, same
parameters, same tying), runs the same steps on both, and compares every gradient. In float32 on
the CPU the comparison is bit for bit wherever each gradient is a sum of at most two terms (then the
order of the sum cannot matter); with more terms the sums are reassociated and the float32
tolerances apply.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import splitgrad
from sg_helpers import (
    DEVICES,
    as_dtype,
    assert_grads_match,
    backward_dw_each,
    delayed_layers,
    make_data,
    run_schedule,
    to_reference,
)

D = 8  # layer width


def linear(delay=True, bias=True, **kw):
    return splitgrad.Linear(D, D, bias=bias, device=kw.pop("device", "cpu"),
                            delay_wgrad_compute=delay, **kw)


def run_once(model, reference, x, gy):
    """One forward/backward on both models, then every delayed layer's W step."""
    model(x).backward(gy)
    reference(x).backward(gy)
    backward_dw_each(model)
    assert splitgrad.pending_wgrads() == 0


# ------------------------------------------------------------------------------------------------
# 1. tying
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delays", list(itertools.product([True, False], repeat=2)),
                         ids=lambda d: "-".join("delayed" if x else "regular" for x in d))
@pytest.mark.parametrize("tie_bias", [False, True], ids=["weight", "weight+bias"])
def test_tied_layers(delays, tie_bias):
    """One Parameter shared by two layers (assigned after construction), any mix of delay flags."""
    model = nn.Sequential(linear(delays[0]), nn.Tanh(), linear(delays[1]))
    model[2].weight = model[0].weight
    if tie_bias:
        model[2].bias = model[0].bias
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=True)


def test_three_tied_layers_mixed_delay():
    """Three layers, one weight, delay flags mixed: three terms per gradient (reassociated)."""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(False), nn.Tanh(), linear(True))
    model[2].weight = model[0].weight
    model[4].weight = model[0].weight
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=False)


# ------------------------------------------------------------------------------------------------
# 2. mixed users
# ------------------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    """An embedding whose table is also the output layer's weight (tied input/output embeddings)."""

    def __init__(self, vocab, delay, sparse=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, D, sparse=sparse)
        self.hidden = linear(delay)
        self.head = splitgrad.Linear(D, vocab, bias=False, device="cpu", delay_wgrad_compute=delay)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


@pytest.mark.parametrize("module", ["Linear", "GroupedLinear"])
def test_a_sparse_grad_of_another_dtype_is_promoted_as_autograd_does(module):
    """grad_dtype=None lets a .grad have any dtype: a float64 weight's sparse float32 .grad becomes
    old + new, dense and float64 (the dtypes promote), as AccumulateGrad makes it."""
    torch.manual_seed(0)
    if module == "Linear":
        layer = splitgrad.Linear(D, D, bias=False, params_dtype=torch.float64, device="cpu",
                                 delay_wgrad_compute=True)
        weight, run = layer.weight, lambda m, x: m(x)
    else:
        layer = splitgrad.GroupedLinear(1, D, D, bias=False, params_dtype=torch.float64,
                                        device="cpu", delay_wgrad_compute=True)
        weight, run = layer.weight0, lambda m, x: m(x, [x.shape[0]])
    reference = nn.Parameter(weight.detach().clone())
    old = torch.randn(D, D).relu().to_sparse()  # float32
    for p in (weight, reference):
        p.grad_dtype = None
        p.grad = old.clone()
    x, gy = torch.randn(5, D, dtype=torch.float64), torch.randn(5, D, dtype=torch.float64)
    run(layer, x).backward(gy)
    layer.backward_dw()
    F.linear(x, reference).backward(gy)
    assert reference.grad.dtype == torch.float64 and reference.grad.layout == torch.strided
    assert weight.grad.dtype == torch.float64 and weight.grad.layout == torch.strided
    torch.testing.assert_close(weight.grad, reference.grad, rtol=0, atol=0)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse-embedding"])
@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_embedding_tied_to_output_layer(delay, sparse):
    """With a sparse embedding, autograd's sum of its sparse and the layer's dense gradient is
    dense; the deferred gradient must be added to the sparse .grad the same way."""
    vocab = 11
    model = TiedLM(vocab, delay, sparse)
    reference = to_reference(model)
    tokens = torch.randint(0, vocab, (3, 4))
    gy = torch.randn(3, 4, vocab)
    run_once(model, reference, tokens, gy)
    if sparse:
        assert model.embed.weight.grad.layout == torch.strided
    # A repeated token's rows are separate terms of a sparse gradient, added to the dense one one
    # by one, (d + e1) + e2, by autograd and splitgrad alike (AccumulateGrad's new + old).
    assert_grads_match(model, reference, exact=True)


class FunctionalReuse(nn.Module):
    """The layer's weight also used by a plain F.linear call."""

    def __init__(self):
        super().__init__()
        self.fc = linear(True)

    def forward(self, x):
        return F.linear(torch.tanh(self.fc(x)), self.fc.weight)


def test_weight_also_used_by_functional_linear():
    model = FunctionalReuse()
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=True)


def test_weight_regulariser():
    """A regulariser on the weight (an ordinary autograd op) plus the deferred contribution."""
    model = nn.Sequential(linear(True))
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    for m in (model, reference):
        y = m(x)
        ((y * gy).sum() + 0.5 * m[0].weight.pow(2).sum()).backward()
    backward_dw_each(model)
    assert_grads_match(model, reference, exact=True)


# ------------------------------------------------------------------------------------------------
# 3. reuse
# ------------------------------------------------------------------------------------------------


class Reuse(nn.Module):
    def __init__(self, times):
        super().__init__()
        self.fc = linear(True)
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.fc(x))
        return x


@pytest.mark.parametrize("times", [2, 3])
def test_layer_applied_several_times(times):
    """One backward pass through a layer applied n times queues n items; one backward_dw() runs
    them all."""
    model = Reuse(times)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    model(x).backward(gy)
    reference(x).backward(gy)
    assert model.fc.pending_wgrads() == times
    model.fc.backward_dw()
    assert model.fc.pending_wgrads() == 0 and splitgrad.pending_wgrads() == 0
    assert_grads_match(model, reference, exact=(times == 2))


# ------------------------------------------------------------------------------------------------
# 4. micro-batches
# ------------------------------------------------------------------------------------------------

SCHEDULES = [
    "F0 F1 B0 B1 W0 W1",
    "F0 B0 F1 W0 B1 W1",
    "F0 B0 W0 F1 B1 W1",
    "F0 F1 B1 B0 W1 W0",  # backward out of forward order: W runs the oldest backward first
    "F0 B0 F1 B1 Wall",
]


class TwoLayers(nn.Module):
    """Two untied delayed layers, passing is_first_microbatch on."""

    def __init__(self):
        super().__init__()
        self.fc1 = linear(True)
        self.fc2 = linear(True)

    def forward(self, x, is_first_microbatch=None):
        h = torch.tanh(self.fc1(x, is_first_microbatch=is_first_microbatch))
        return self.fc2(h, is_first_microbatch=is_first_microbatch)


def w_step(model):
    def step(token):
        if token == "Wall":
            splitgrad.backward_dw_all()
        else:
            backward_dw_each(model)
    return step


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("first_microbatch", [False, True], ids=["no-flag", "is_first_microbatch"])
def test_microbatch_schedules(schedule, first_microbatch):
    model = TwoLayers()
    reference = to_reference(model)
    xs, gys = make_data(2, (4, D), D)

    def forward(m, x, i):
        return m(x, is_first_microbatch=(i == 0)) if first_microbatch else m(x)

    run_schedule(schedule, model, xs, gys, w_step=w_step(model), forward=forward)
    run_schedule(schedule, reference, xs, gys, forward=forward)
    assert splitgrad.pending_wgrads() == 0
    assert_grads_match(model, reference, exact=True)


def test_three_microbatches_tied():
    """Three micro-batches through tied layers: six terms per gradient (reassociated)."""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(True))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    xs, gys = make_data(3, (4, D), D)
    schedule = "F0 F1 B0 F2 B1 W0 B2 W1 W2"
    run_schedule(schedule, model, xs, gys, w_step=w_step(model))
    run_schedule(schedule, reference, xs, gys)
    assert_grads_match(model, reference, exact=False)


def test_input_gradient_only_backward():
    """backward(inputs=[x]) asks autograd for the input gradient only: as in plain autograd, no
    parameter gets a gradient from it, so the delayed layers queue nothing. (A pipeline's B step
    runs a full backward: torch's PipelineStage with a dw_builder, see splitgrad.pipelining.)"""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(True))
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (4, D), D)
    x_model = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    model(x_model).backward(gy, inputs=[x_model])
    reference(x_ref).backward(gy, inputs=[x_ref])
    assert splitgrad.pending_wgrads() == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in reference.parameters())
    torch.testing.assert_close(x_model.grad, x_ref.grad, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# 5. bias
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bias_accumulates_like_weight(tied):
    """Bias gradients over two micro-batches (and two tied layers): += every time, as the weight."""
    model = nn.Sequential(linear(True, bias=True), nn.Tanh(), linear(True, bias=True))
    if tied:
        model[2].bias = model[0].bias
    reference = to_reference(model)
    xs, gys = make_data(2, (3, 2, D), D)
    schedule = "F0 B0 F1 B1 W0 W1"
    run_schedule(schedule, model, xs, gys, w_step=w_step(model))
    run_schedule(schedule, reference, xs, gys)
    # tied: 2 layers x 2 micro-batches = 4 terms per bias element; untied: 2.
    assert_grads_match(model, reference, exact=not tied)


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_one_of_weight_and_bias_frozen(frozen):
    """Only the trainable one of weight and bias gets a deferred gradient."""
    model = nn.Sequential(linear(True))
    getattr(model[0], frozen).requires_grad_(False)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert getattr(model[0], frozen).grad is None
    assert_grads_match(model, reference, exact=True)


# ------------------------------------------------------------------------------------------------
# 6. order
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))) + ["all"],
                         ids=lambda o: o if o == "all" else "".join(map(str, o)))
def test_deferred_work_order(order):
    """Three layers' deferred work, two micro-batches, run layer by layer in any order (or by
    backward_dw_all): the same gradients."""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(True), nn.Tanh(), linear(True))
    reference = to_reference(model)
    xs, gys = make_data(2, (4, D), D)
    run_schedule("F0 F1 B0 B1", model, xs, gys)
    run_schedule("F0 F1 B0 B1", reference, xs, gys)
    layers = delayed_layers(model)
    if order == "all":
        splitgrad.backward_dw_all()
    else:
        for _ in range(2):
            for i in order:
                layers[i].backward_dw()
    assert splitgrad.pending_wgrads() == 0
    assert_grads_match(model, reference, exact=True)


@pytest.mark.parametrize("order", ["forward", "reverse", "all"])
def test_tied_deferred_work_order(order):
    """Tied weights, two micro-batches, deferred work in different orders: equal up to
    reassociation."""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(True), nn.Tanh(), linear(True))
    model[4].weight = model[0].weight
    model[2].bias = model[0].bias
    reference = to_reference(model)
    xs, gys = make_data(2, (4, D), D)
    run_schedule("F0 B0 F1 B1", model, xs, gys)
    run_schedule("F0 B0 F1 B1", reference, xs, gys)
    layers = delayed_layers(model)
    if order == "all":
        splitgrad.backward_dw_all()
    else:
        for _ in range(2):
            for layer in (layers if order == "forward" else layers[::-1]):
                layer.backward_dw()
    assert_grads_match(model, reference, exact=False)


# ------------------------------------------------------------------------------------------------
# 7. existing gradients
# ------------------------------------------------------------------------------------------------


def test_existing_grad_is_added_to():
    model = nn.Sequential(linear(True))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=True)


def test_existing_grad_tied_mixed_delay():
    """A pre-filled gradient of a weight tied between a delayed and a regular layer."""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(False))
    model[2].weight = model[0].weight
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=False)  # 3 terms on the tied weight


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_existing_main_grad_is_added_to(delay):
    model = nn.Sequential(linear(delay, fuse_wgrad_accumulation=True))
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, dtype=torch.float32)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=True)  # float32 main_grad + one float32 term


# ------------------------------------------------------------------------------------------------
# fuse_wgrad_accumulation: main_grad
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_fused_main_grad(delay, dtype, device):
    """Tied fused layers, two micro-batches: gradients land in fp32 main_grad,
    grad_added_to_main_grad is set, .grad stays None."""
    model = nn.Sequential(linear(delay, fuse_wgrad_accumulation=True, params_dtype=dtype, device=device),
                          nn.Tanh(),
                          linear(delay, fuse_wgrad_accumulation=True, params_dtype=dtype, device=device))
    model[2].weight = model[0].weight
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
        p.grad_added_to_main_grad = False
    reference = to_reference(model)
    high = to_reference(model, torch.float64)
    xs, gys = make_data(2, (4, D), D, dtype=dtype, device=device)
    schedule = "F0 F1 B0 B1 W0 W1"
    run_schedule(schedule, model, xs, gys, w_step=w_step(model))
    run_schedule(schedule, reference, xs, gys)
    run_schedule(schedule, high, as_dtype(xs, torch.float64), as_dtype(gys, torch.float64))
    for p in model.parameters():
        assert p.grad is None
        assert p.grad_added_to_main_grad is True
        assert p.main_grad.dtype == torch.float32
    assert_grads_match(model, reference, exact=False, high_precision=high)


def test_fused_does_not_create_grad_added_to_main_grad():
    """grad_added_to_main_grad is set only where the attribute exists (Megatron creates it)."""
    model = nn.Sequential(linear(True, fuse_wgrad_accumulation=True))
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (5, D), D)
    run_once(model, reference, x, gy)
    assert not any(hasattr(p, "grad_added_to_main_grad") for p in model.parameters())
    assert_grads_match(model, reference, exact=False)


# ------------------------------------------------------------------------------------------------
# dtypes and input ranks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
def test_dtypes(dtype, device):
    """Tied delayed layers with biases in each dtype; bf16/fp16 against a float64 reference,
    within 2x PyTorch's own low-precision error."""
    model = nn.Sequential(linear(True, params_dtype=dtype, device=device), nn.Tanh(),
                          linear(True, params_dtype=dtype, device=device))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    high = to_reference(model, torch.float64)
    xs, gys = make_data(2, (6, D), D, dtype=dtype, device=device)
    schedule = "F0 B0 F1 B1 W0 W1"
    run_schedule(schedule, model, xs, gys, w_step=w_step(model))
    run_schedule(schedule, reference, xs, gys)
    run_schedule(schedule, high, as_dtype(xs, torch.float64), as_dtype(gys, torch.float64))
    for p in model.parameters():
        assert p.grad.dtype == dtype
    # 2 micro-batches: untied params have 2 terms (exact in float32); the tied weight has 4.
    assert_grads_match(model, reference, exact=False, high_precision=high)
    if dtype == torch.float32 and device == "cpu":
        for name in ("0.bias", "2.bias"):
            torch.testing.assert_close(dict(model.named_parameters())[name].grad,
                                       dict(reference.named_parameters())[name].grad, rtol=0, atol=0)


def _non_contiguous(shape):
    x = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1])
    return x.transpose(-3, -2)


INPUTS = {
    "1d": lambda: torch.randn(D),
    "2d": lambda: torch.randn(5, D),
    "3d": lambda: torch.randn(3, 5, D),
    "4d": lambda: torch.randn(2, 3, 5, D),
    "3d-non-contiguous": lambda: _non_contiguous((3, 5, D)),
}


@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_input_ranks(kind, bias):
    """Inputs [D], [T, D], [B, T, D], [A, B, T, D] and a transposed (non-contiguous) 3-D input."""
    model = nn.Sequential(linear(True, bias=bias), nn.Tanh(), linear(True, bias=bias))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    x = INPUTS[kind]()
    assert x.is_contiguous() == ("non-contiguous" not in kind)
    gy = torch.randn(x.shape)
    run_once(model, reference, x, gy)
    assert_grads_match(model, reference, exact=True)
