"""splitgrad.GroupedLinear (MoE experts) against per-expert plain autograd (one F.linear per expert on
its rows, sg_helpers.RefGroupedLinear) on the same weights.

On the CPU each expert runs the GEMMs nn.Linear runs on the same rows, so outputs, input gradients
and parameter gradients are compared bit for bit (atol = rtol = 0) in every dtype wherever the
contributions to a gradient are added in the same order; CUDA runs compare with the dtype's
tolerance (fp32) or against a float64 reference relative to PyTorch's own error (bf16/fp16).
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn
from torch.library import opcheck

import splitgrad
from sg_helpers import (DEVICES, NO_CUDA, assert_grads_match, backward_under_compiled_autograd, named_gradients,
                        run_schedule, to_reference, unwritable_grad)

ops = torch.ops.splitgrad

IN, OUT = 6, 5

SPLITS = {
    "mixed-with-zeros": [3, 0, 4, 0, 2],
    "one-takes-all": [0, 0, 9, 0, 0],
    "all-first": [9, 0, 0, 0, 0],
    "no-rows": [0, 0, 0, 0, 0],
}


def _exact(device, dtype=torch.float32) -> bool:
    return device == "cpu"


def _assert_same_grads(model, reference, *, device, dtype, high=None):
    """Bit for bit on the CPU (every dtype: the same ATen GEMMs run on both sides); on CUDA the
    dtype's tolerance (fp32) or the float64 criterion (bf16/fp16)."""
    if device == "cpu":
        actual, expected = named_gradients(model), named_gradients(reference)
        assert list(actual) == list(expected)
        for name, got in actual.items():
            want = expected[name]
            assert (got is None) == (want is None), f"{name}: {got} vs {want}"
            if got is not None:
                torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0,
                                           msg=lambda m, name=name: f"{name} (expected bit-identical): {m}")
    else:
        assert_grads_match(model, reference, exact=False, high_precision=high)


def _data(splits, dtype=torch.float32, device="cpu", lead=None):
    rows = sum(splits)
    shape = (rows, IN) if lead is None else (*lead, IN)
    x = torch.randn(*shape).to(dtype=dtype, device=device)
    gy = torch.randn(*shape[:-1], OUT).to(dtype=dtype, device=device)
    return x, gy


def _layer(device="cpu", dtype=torch.float32, n=5, **kw):
    return splitgrad.GroupedLinear(n, IN, OUT, params_dtype=dtype, device=device, **kw)


# ------------------------------------------------------------------------------------------------
# Exactness against per-expert autograd
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_matches_per_expert_autograd(device, splits, bias, delay, as_tensor):
    layer = _layer(device, bias=bias, delay_wgrad_compute=delay)
    reference = to_reference(layer)
    x, gy = _data(splits, device=device)
    m_splits = torch.tensor(splits, device=device) if as_tensor else splits
    xs = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    y = layer(xs, m_splits)
    y_ref = reference(xr, splits)
    tol = {} if device == "cpu" else {"rtol": 1.3e-6 if not torch.backends.cuda.matmul.allow_tf32 else 1e-2, "atol": 1e-5}
    torch.testing.assert_close(y, y_ref, **({"rtol": 0, "atol": 0} if device == "cpu" else tol))
    y.backward(gy)
    y_ref.backward(gy)
    torch.testing.assert_close(xs.grad, xr.grad, **({"rtol": 0, "atol": 0} if device == "cpu" else tol))
    if delay:
        assert layer.pending_wgrads() == 1  # one item for all the experts
        assert all(p.grad is None for p in layer.parameters())
        layer.backward_dw()
    assert layer.pending_wgrads() == 0
    _assert_same_grads(layer, reference, device=device, dtype=torch.float32)
    if sum(splits) == 0 or 0 in splits:  # an expert without rows gets zeros, as nn.Linear's does
        for i, s in enumerate(splits):
            if s == 0:
                assert torch.count_nonzero(layer.weights[i].grad) == 0


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_leading_dims_are_flattened(delay):
    layer = _layer(n=3, delay_wgrad_compute=delay)
    reference = to_reference(layer)
    x, gy = _data([4, 0, 2], lead=(2, 3))
    layer(x, [4, 0, 2]).backward(gy)
    reference(x, [4, 0, 2]).backward(gy)
    layer.backward_dw()
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_dtypes_cpu_bitwise(dtype, delay):
    """bf16/fp16/fp64 on the CPU: the same ATen GEMMs in the same dtype, so bit for bit too."""
    layer = _layer(dtype=dtype, delay_wgrad_compute=delay)
    reference = to_reference(layer)
    splits = SPLITS["mixed-with-zeros"]
    x, gy = _data(splits, dtype=dtype)
    y, y_ref = layer(x, splits), reference(x, splits)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    y.backward(gy)
    y_ref.backward(gy)
    layer.backward_dw()
    _assert_same_grads(layer, reference, device="cpu", dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("splits_on", ["cpu", "cuda"])
def test_low_precision_cuda(dtype, delay, splits_on):
    """cuBLASLt per expert: within 2x PyTorch's own error against a float64 reference."""
    layer = _layer("cuda", dtype=dtype, delay_wgrad_compute=delay)
    reference = to_reference(layer)
    high = to_reference(layer, torch.float64)
    splits = [40, 0, 7, 0, 17]
    x, gy = _data(splits, dtype=dtype, device="cuda")
    layer(x, torch.tensor(splits, device=splits_on)).backward(gy)
    reference(x, splits).backward(gy)
    high(x.double(), splits).backward(gy.double())
    layer.backward_dw()
    assert_grads_match(layer, reference, exact=False, high_precision=high)


# ------------------------------------------------------------------------------------------------
# Tying, micro-batches, W order
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_experts_tied_to_each_other(delay):
    layer = _layer(delay_wgrad_compute=delay)
    layer.weight3 = layer.weight1
    layer.bias4 = layer.bias0
    reference = to_reference(layer)
    splits = [2, 3, 1, 4, 2]
    x, gy = _data(splits)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    layer.backward_dw()
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in reference.named_parameters()]
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("tied", [[1, 3, 4], [0, 1, 2, 4]], ids=["3-tied", "4-tied"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_three_or_four_tied_experts_sum_as_per_expert_autograd(tied, delay):
    """A weight and a bias tied across 3 or 4 experts: per-expert autograd adds their values in
    reverse expert order ((v4 + v3) + v1, the last expert's backward running first), which in fp32
    differs from slot order. The regular path (one summed gradient returned to autograd) and the
    delayed one both match it bit for bit."""
    layer = _layer(n=5, delay_wgrad_compute=delay)
    for i in tied[1:]:
        setattr(layer, f"weight{i}", layer.weights[tied[0]])
        setattr(layer, f"bias{i}", layer.biases[tied[0]])
    reference = to_reference(layer)
    splits = [3, 4, 5, 6, 2]
    x, gy = _data(splits)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    layer.backward_dw()
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    # the data tell the orders apart: slot order gives other bits
    xs, gys = x.split(splits), gy.split(splits)
    weight_values = [gys[i].t() @ xs[i] for i in tied]
    bias_values = [gys[i].sum(0) for i in tied]
    in_slot_order = [sum(values[1:], values[0]) for values in (weight_values, bias_values)]
    in_reverse = [sum(values[-2::-1], values[-1]) for values in (weight_values, bias_values)]
    name = f"weight{tied[0]}"
    assert torch.equal(dict(reference.named_parameters())[name].grad, in_reverse[0])
    assert not torch.equal(in_slot_order[0], in_reverse[0])
    assert not torch.equal(in_slot_order[1], in_reverse[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("passes", [1, 2])
def test_kept_grads_of_tied_experts_get_the_pass_sum_as_autograd(device, dtype, passes):
    """.grads already there (set before, or from an earlier pass) get each pass's value with one
    add_, and experts tied to each other (weight3 = weight1, bias2 = bias0) the sum of their
    groups' values first, as AccumulateGrad gets the pass's sum: old + (v3 + v1). On the CPU
    against per-expert autograd bit for bit; on CUDA against that formula on the grouped op's own
    values (which backward_dw() runs)."""
    layer = _layer(device=device, dtype=dtype, n=5, delay_wgrad_compute=True)
    layer.weight3 = layer.weight1
    layer.bias2 = layer.bias0
    reference = to_reference(layer)
    splits = [3, 2, 1, 4, 5]
    data = [_data(splits, dtype=dtype, device=device) for _ in range(passes)]
    old = {name: torch.randn(p.shape).to(dtype=dtype, device=device) for name, p in layer.named_parameters()}
    for name, p in [*layer.named_parameters(), *reference.named_parameters()]:
        p.grad = old[name].clone()
    for x, gy in data:
        layer(x, splits).backward(gy)
        reference(x, splits).backward(gy)
    for _ in data:
        layer.backward_dw()
    if device == "cpu":
        _assert_same_grads(layer, reference, device=device, dtype=dtype)
        return
    expected = {name: grad.clone() for name, grad in old.items()}
    for x, gy in data:
        weights, biases = torch.ops.splitgrad.grouped_linear_wgrad(gy, x, torch.tensor(splits), True)
        for i in (0, 2, 4):
            expected[f"weight{i}"].add_(weights[i])
        expected["weight1"].add_(weights[3] + weights[1])
        for i in (1, 3, 4):
            expected[f"bias{i}"].add_(biases[i])
        expected["bias0"].add_(biases[2] + biases[0])
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)


def test_a_grad_that_cannot_be_added_to_leaves_the_other_experts_unwritten():
    """An expert's .grad that cannot be added to in place (an inference tensor) raises, as
    autograd does; the item is dropped and reported for every expert, and no other expert's
    gradient was written (the adds that can fail come first)."""
    layer = _layer(n=3, delay_wgrad_compute=True)
    with torch.inference_mode():
        layer.weight0.grad = torch.zeros(OUT, IN)
    splits = [2, 2, 2]
    x, gy = _data(splits)
    layer(x, splits).backward(gy)
    with pytest.raises(RuntimeError, match="inference tensor"):
        layer.backward_dw()
    assert layer.pending_wgrads() == 0
    for name, p in layer.named_parameters():
        assert splitgrad._C.dropped_wgrads_for(p) == 1, name
        if name != "weight0":
            assert p.grad is None, name


@pytest.mark.parametrize("how", ["inference", "expanded"])
@pytest.mark.parametrize("bad", ["weight0", "bias1"])
def test_an_unwritable_grad_among_kept_grads_writes_nothing(bad, how):
    """Every expert holds a .grad (kept between micro-batches) and one cannot be added to in
    place: backward_dw() raises naming the layer and that parameter, before anything is written
    (the grouped op adds to biases' .grads in place: those adds come after the check too). The
    item is dropped and reported for every expert; every .grad is as it was."""
    layer = _layer(n=3, delay_wgrad_compute=True, name="experts")
    params = dict(layer.named_parameters())
    for name, p in params.items():
        p.grad = unwritable_grad(p, how) if name == bad else torch.randn_like(p)
    before = {name: p.grad.clone() for name, p in params.items()}
    splits = [2, 2, 2]
    x, gy = _data(splits)
    layer(x, splits).backward(gy)
    match = "inference tensor" if how == "inference" else "share memory"
    with pytest.raises(RuntimeError, match=rf"'experts'.*\.grad of {bad}: .*{match}"):
        layer.backward_dw()
    assert layer.pending_wgrads() == 0
    for name, p in params.items():
        assert splitgrad._C.dropped_wgrads_for(p) == 1, name
        torch.testing.assert_close(p.grad, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_one_grad_tensor_shared_by_two_experts_gets_both_values(device, kind):
    """A tensor set as the .grad of two experts' weights (or biases) gets both values, each with
    add_ (not one lost to a race in a multi-tensor add), in the order per-expert autograd adds
    them (the later expert's first); on the CPU bit for bit as per-expert autograd leaves it.
    The biases' case has frozen weights: with no weight gradient to make, the bias kernel would
    add to the .grads in place, in its own group order."""
    layer = _layer(device=device, n=3, delay_wgrad_compute=True, bias=kind == "bias")
    if kind == "bias":
        for weight in layer.weights:
            weight.requires_grad_(False)
    reference = to_reference(layer)
    params, reference_params = dict(layer.named_parameters()), dict(reference.named_parameters())
    start = torch.randn(params[f"{kind}0"].shape, device=device)
    shared, shared_reference = start.clone(), start.clone()
    params[f"{kind}0"].grad = params[f"{kind}2"].grad = shared
    reference_params[f"{kind}0"].grad = reference_params[f"{kind}2"].grad = shared_reference
    splits = [4, 1, 3]
    x, gy = _data(splits, device=device)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    layer.backward_dw()
    assert params[f"{kind}0"].grad is shared and params[f"{kind}2"].grad is shared
    weights, biases = torch.ops.splitgrad.grouped_linear_wgrad(gy, x, torch.tensor(splits), kind == "bias")
    values = weights if kind == "weight" else biases
    torch.testing.assert_close(shared, start + values[2] + values[0], rtol=0, atol=0)
    if device == "cpu":
        torch.testing.assert_close(shared, shared_reference, rtol=0, atol=0)
        torch.testing.assert_close(params[f"{kind}1"].grad, reference_params[f"{kind}1"].grad,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_tied_expert_sharing_a_grad_tensor_gets_its_sum_after_its_lowest_expert(device, kind):
    """weight2 = weight0 (or the biases), and one tensor is the .grad of that tied parameter and
    of expert 1's: per-expert autograd adds expert 1's value first, and the tied parameter's sum
    only once its lowest expert (0) has run: G + v1 + (v2 + v0), not G + (v2 + v0) + v1. On the
    CPU bit for bit as per-expert autograd leaves it. Frozen weights in the biases' case, as in
    the test above."""
    layer = _layer(device=device, n=3, delay_wgrad_compute=True, bias=kind == "bias")
    if kind == "bias":
        for weight in layer.weights:
            weight.requires_grad_(False)
    setattr(layer, f"{kind}2", getattr(layer, f"{kind}0"))
    reference = to_reference(layer)
    tied, other = getattr(layer, f"{kind}0"), getattr(layer, f"{kind}1")
    tied_reference, other_reference = getattr(reference, f"{kind}0"), getattr(reference, f"{kind}1")
    start = torch.randn(tied.shape, device=device)
    shared, shared_reference = start.clone(), start.clone()
    tied.grad = other.grad = shared
    tied_reference.grad = other_reference.grad = shared_reference
    splits = [4, 1, 3]
    x, gy = _data(splits, device=device)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    layer.backward_dw()
    assert tied.grad is shared and other.grad is shared
    weights, biases = torch.ops.splitgrad.grouped_linear_wgrad(gy, x, torch.tensor(splits), kind == "bias")
    v = weights if kind == "weight" else biases
    torch.testing.assert_close(shared, start + v[1] + (v[2] + v[0]), rtol=0, atol=0)
    if device == "cpu":
        torch.testing.assert_close(shared, shared_reference, rtol=0, atol=0)
        # the data tell the orders apart
        assert not torch.equal(start + v[1] + (v[2] + v[0]), start + (v[2] + v[0]) + v[1])


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_tied_experts_with_an_fp32_grad_dtype_sum_in_fp32(delay):
    """bf16 experts tied to each other whose .grad is kept in fp32 (grad_dtype): autograd casts
    each expert's value to fp32 before adding them, f32(v2) + f32(v0), not f32(v2 + v0) summed in
    bf16; bit for bit as per-expert autograd, on the regular and the delayed path."""
    layer = _layer(n=3, dtype=torch.bfloat16, delay_wgrad_compute=delay)
    layer.weight2 = layer.weight0
    layer.bias2 = layer.bias0
    reference = to_reference(layer)
    for model in (layer, reference):
        for p in model.parameters():
            p.grad_dtype = torch.float32
    splits = [3, 2, 4]
    x, gy = _data(splits, dtype=torch.bfloat16)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    layer.backward_dw()
    for p in layer.parameters():
        assert p.grad.dtype == torch.float32
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.bfloat16)
    weights, _ = torch.ops.splitgrad.grouped_linear_wgrad(gy, x, torch.tensor(splits), True)
    # the data tell the roundings apart
    assert not torch.equal(weights[2].float() + weights[0].float(), (weights[2] + weights[0]).float())


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_tied_fp32_experts_under_autocast_sum_in_bf16_as_autograd(delay):
    """Under autocast, a tied fp32 weight is cast to bf16 once (autocast's cache): autograd sums
    its experts' bf16 values before that cast's backward, f32(v2 + v0), unlike an fp32 grad_dtype
    (the test above); bit for bit as per-expert autograd, on the regular and the delayed path."""
    layer = _layer(n=3, delay_wgrad_compute=delay)
    layer.weight2 = layer.weight0
    layer.bias2 = layer.bias0
    reference = to_reference(layer)
    splits = [3, 2, 4]
    x, gy = _data(splits)
    gy = gy.bfloat16()
    for model in (layer, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x, splits)
        y.backward(gy)
    layer.backward_dw()
    for p in layer.parameters():
        assert p.grad.dtype == torch.float32
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    weights, _ = torch.ops.splitgrad.grouped_linear_wgrad(gy, x.bfloat16(), torch.tensor(splits), True)
    torch.testing.assert_close(layer.weight0.grad, (weights[2] + weights[0]).float(), rtol=0, atol=0)
    assert not torch.equal(weights[2].float() + weights[0].float(), (weights[2] + weights[0]).float())


@pytest.mark.parametrize("linear_delay", [False, True], ids=["linear-regular", "linear-delayed"])
@pytest.mark.parametrize("grouped_delay", [False, True], ids=["grouped-regular", "grouped-delayed"])
def test_expert_tied_to_another_layer(linear_delay, grouped_delay):
    """An expert's weight and bias shared with a splitgrad.Linear (delayed or not) and used by an
    ordinary op too; every contribution accumulates."""
    lin = splitgrad.Linear(IN, OUT, device="cpu", delay_wgrad_compute=linear_delay)
    experts = _layer(n=3, delay_wgrad_compute=grouped_delay)
    experts.weight2 = lin.weight
    experts.bias2 = lin.bias
    model = nn.ModuleDict({"lin": lin, "experts": experts})
    reference = to_reference(model)
    splits = [3, 0, 4]
    x, gy = _data(splits)

    def step(m, backward_dw):
        y = m["experts"](x, splits) + m["lin"](x)
        (y * gy).sum().backward()
        if backward_dw:
            splitgrad.backward_dw_all()

    step(model, True)
    step(reference, False)
    # Two contributions each (no earlier .grad): their sum does not depend on the order.
    _assert_same_grads(model, reference, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("schedule", ["F0 F1 B0 B1 W0 W1", "F0 B0 F1 W0 B1 W1", "F0 F1 B1 B0 W1 W0",
                                      "F0 F1 F2 B2 B0 B1 Wall"])
@pytest.mark.parametrize("first_microbatch", [False, True], ids=["plain", "is_first_microbatch"])
def test_microbatch_interleavings(schedule, first_microbatch):
    """Several micro-batches (different routings) queued before their W steps, in any interleaving;
    a W step runs the oldest pending pass, in the order the backward passes ran, as autograd adds."""
    layer = _layer(delay_wgrad_compute=True)
    reference = to_reference(layer)
    routing = [[3, 0, 4, 0, 2], [0, 9, 0, 0, 0], [1, 2, 3, 2, 1]]
    xs = [_data(s)[0] for s in routing]
    gys = [_data(s)[1] for s in routing]

    def forward(m, x, i):
        return m(x, routing[i], is_first_microbatch=(i == 0) if first_microbatch else None)

    run_schedule(schedule, layer, xs, gys, forward=forward,
                 w_step=lambda t: splitgrad.backward_dw_all() if t == "Wall" else layer.backward_dw())
    run_schedule(schedule, reference, xs, gys, forward=forward)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


def test_applied_twice_in_one_pass():
    """Two applications in one forward queue two items of one pass; one backward_dw runs both."""
    layer = _layer(n=3, delay_wgrad_compute=True)
    reference = to_reference(layer)
    (x1, gy1), (x2, gy2) = _data([3, 1, 2]), _data([0, 4, 1])
    for m in (layer, reference):
        ((m(x1, [3, 1, 2]) * gy1).sum() + (m(x2, [0, 4, 1]) * gy2).sum()).backward()
    assert layer.pending_wgrads() == 2
    layer.backward_dw()
    assert layer.pending_wgrads() == 0
    # Two contributions per parameter, no earlier .grad: the order of the sum does not matter.
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


# ------------------------------------------------------------------------------------------------
# fuse_wgrad_accumulation, hooks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("bias_main_grad", [False, True], ids=["bias-grad", "bias-main_grad"])
def test_fused_main_grad(device, delay, bias_main_grad):
    layer = _layer(device, delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
    for p in layer.weights + (layer.biases if bias_main_grad else []):
        p.main_grad = torch.randn(p.shape, device=device)  # an earlier value: added to, not replaced
        p.grad_added_to_main_grad = False
    reference = to_reference(layer)  # its .grad starts at main_grad's value
    splits = SPLITS["mixed-with-zeros"]
    x, gy = _data(splits, device=device)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    layer.backward_dw()
    for w in layer.weights:
        assert w.grad is None and w.grad_added_to_main_grad is True
    for b in layer.biases:
        assert (b.grad is None) == bias_main_grad
    _assert_same_grads(layer, reference, device=device, dtype=torch.float32)


def test_fused_main_grad_bf16_params():
    """bf16 experts, fp32 main_grad: the products are summed in fp32 (closer to float64 than
    PyTorch's bf16 gradient)."""
    layer = _layer(dtype=torch.bfloat16, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, bias=False)
    for w in layer.weights:
        w.main_grad = torch.zeros(w.shape)
    reference = to_reference(layer)
    high = to_reference(layer, torch.float64)
    splits = [30, 0, 12, 1, 21]
    x, gy = _data(splits, dtype=torch.bfloat16)
    layer(x, splits).backward(gy)
    reference(x, splits).backward(gy)
    high(x.double(), splits).backward(gy.double())
    layer.backward_dw()
    for w, w_ref, w_high in zip(layer.weights, reference.parameters(), high.parameters()):
        err = (w.main_grad.double() - w_high.grad).abs().max().item()
        err_torch = (w_ref.grad.double() - w_high.grad).abs().max().item()
        assert err <= err_torch + 1e-6


def test_fused_without_main_grad_is_an_error():
    layer = _layer(fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    for w in layer.weights[:2]:
        w.main_grad = torch.zeros(w.shape)
    with pytest.raises(splitgrad.MainGradError, match="weight2.main_grad"):
        layer(torch.randn(3, IN), [1, 1, 1, 0, 0])
    for w in layer.weights[3:]:
        w.main_grad = torch.zeros(w.shape)
    layer.weight2.main_grad = torch.zeros(OUT, IN + 1)
    with pytest.raises(splitgrad.MainGradError, match=r"weight2.main_grad of shape \[5, 6\] \(the parameter's\), got \[5, 7\]"):
        layer(torch.randn(3, IN), [1, 1, 1, 0, 0])
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_hooks_once_per_pass_even_without_rows(delay):
    layer = _layer(delay_wgrad_compute=delay)
    layer.weight4 = layer.weight3  # a shared parameter's hook fires once too
    calls: list[str] = []
    names = {id(p): n for n, p in layer.named_parameters()}
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda p: calls.append(names[id(p)]))
    for splits in ([0, 7, 0, 0, 0], [2, 0, 3, 0, 1]):
        calls.clear()
        layer(torch.randn(sum(splits), IN), splits).sum().backward()
        if delay:
            assert calls == []  # nothing is complete before the deferred work
            layer.backward_dw()
        assert sorted(calls) == sorted(names.values()), calls


def test_hooks_of_one_item_see_all_of_it_landed_and_a_throwing_hook_stops_none():
    """backward_dw() lands all of an item's targets under one ledger lock before any hook runs: each
    hook sees every expert's gradient written and nothing pending; a hook that throws does not keep
    the others from running, and its error comes out of backward_dw()."""
    layer = _layer(delay_wgrad_compute=True)
    params = list(layer.parameters())
    seen: list[tuple[int, bool]] = []

    def hook(p):
        # the ledger's count of deferred contributions still owed (what the FSDP wrapper asks)
        owed = sum(splitgrad._C.pending_wgrads_for(q) for q in params)
        seen.append((owed, all(q.grad is not None for q in params)))
        if p is layer.weight0:
            raise ValueError("hook failed")

    layer.register_wgrad_accumulation_and_reduce_hooks(hook)
    layer(torch.randn(6, IN), [2, 0, 3, 0, 1]).sum().backward()
    with pytest.raises(ValueError, match="hook failed"):
        layer.backward_dw()
    assert seen == [(0, True)] * len(params)
    assert splitgrad.pending_wgrads() == 0


def test_grad_ready_hook_after_last_contribution_with_tied_linear():
    lin = splitgrad.Linear(IN, OUT, device="cpu", delay_wgrad_compute=True)
    experts = _layer(n=2, delay_wgrad_compute=True, bias=False)
    experts.weight1 = lin.weight
    seen = []
    splitgrad.register_grad_ready_hook(lin.weight, lambda p: seen.append(p.grad.clone()))
    x = torch.randn(4, IN)
    (experts(x, [2, 2]).sum() + lin(x).sum()).backward()
    experts.backward_dw()
    assert seen == []
    lin.backward_dw()
    assert len(seen) == 1 and torch.equal(seen[0], lin.weight.grad)


# ------------------------------------------------------------------------------------------------
# Misuse: errors before anything is queued
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m_splits, error, message",
    [
        ([3, 1, 1, 1, 1], splitgrad.ArgumentError, r"to sum to the input's 6 rows \(tokens\), got a sum of 7"),
        ([3, -1, 2, 1, 1], splitgrad.ArgumentError, r"non-negative m_splits, got m_splits\[1\] = -1"),
        # 2 * INT64_MAX + 8 wraps around to the 6 rows in int64: refused, not run
        ([2**63 - 1, 2**63 - 1, 8, 0, 0], splitgrad.ArgumentError, r"past the int64 range at m_splits\[1\]"),
        (torch.tensor([2**63 - 1, 2**63 - 1, 8, 0, 0]), splitgrad.ArgumentError, r"past the int64 range at m_splits\[1\]"),
        ([3, 3], splitgrad.ArgumentError, "expected 5 splits"),
        (torch.tensor([3, 3]), splitgrad.ArgumentError, "expected 5 splits"),
        (torch.tensor([[3, 3, 0, 0, 0]]), splitgrad.ArgumentError, r"1-D m_splits, got shape \[1, 5\]"),
        (torch.tensor([3.0, 3, 0, 0, 0]), splitgrad.DTypeError, "integer dtype"),
        (torch.tensor([True] * 5), splitgrad.DTypeError, "integer dtype"),
        ([3, 3, 0, 0, 0.0], splitgrad.DTypeError, r"m_splits\[4\] = 0.0"),
        ("33000", TypeError, "list of ints or an integer tensor"),
        (torch.tensor([3, 3, 0, 0, 0], device="meta"), RuntimeError, "expected m_splits on the CPU for input on cpu"),
    ],
)
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_bad_splits(m_splits, error, message, delay):
    layer = _layer(delay_wgrad_compute=delay, name="moe.experts")
    x = torch.randn(6, IN, requires_grad=True)
    with pytest.raises(error, match=message) as info:
        layer(x, m_splits)
    if not isinstance(m_splits, str):
        assert "moe.experts" in str(info.value)
    assert splitgrad.pending_wgrads() == 0


def test_numpy_integer_splits_are_taken():
    np = pytest.importorskip("numpy")
    layer = _layer()
    reference = to_reference(layer)
    x, gy = _data([1, 2, 0, 0, 3])
    layer(x, list(np.array([1, 2, 0, 0, 3]))).backward(gy)
    reference(x, [1, 2, 0, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    with pytest.raises(splitgrad.DTypeError, match=r"m_splits\[0\] = True"):
        layer(x, [True, 2, 0, 0, 3])


def test_numpy_integer_arrays_are_taken():
    """np.bincount's counts (int64), and other integer numpy dtypes; a non-integer array is refused."""
    np = pytest.importorskip("numpy")
    layer = _layer(name="moe.experts")
    reference = to_reference(layer)
    x, gy = _data([1, 2, 0, 0, 3])
    routed = np.array([0, 1, 1, 4, 4, 4])
    for m_splits in (np.bincount(routed, minlength=5), np.array([1, 2, 0, 0, 3], dtype=np.int32),
                     np.array([1, 2, 0, 0, 3], dtype=np.uint8)):
        layer(x, m_splits).backward(gy)
        reference(x, [1, 2, 0, 0, 3]).backward(gy)
        _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    with pytest.raises(splitgrad.DTypeError, match="moe.experts.*integer dtype.*float64"):
        layer(x, np.array([1.0, 2, 0, 0, 3]))


def test_a_list_of_0d_tensors_is_stacked_where_it_is():
    """A list of 0-d integer tensors (``list(counts)``, ``counts.unbind()``) is stacked on its device,
    not read on the host (meta tensors cannot be read: the stacked splits stay meta)."""
    layer = _layer(name="moe.experts")
    reference = to_reference(layer)
    x, gy = _data([1, 2, 0, 0, 3])
    counts = torch.tensor([1, 2, 0, 0, 3], dtype=torch.int32)
    layer(x, list(counts)).backward(gy)
    reference(x, [1, 2, 0, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    meta = layer._splits_tensor(list(torch.tensor([1, 2, 0, 0, 3], device="meta").unbind()))
    assert meta.is_meta and meta.shape == (5,) and meta.dtype == torch.int64
    with pytest.raises(splitgrad.DTypeError, match=r"moe.experts.*0-d integer tensors.*m_splits\[1\]"):
        layer(x, [torch.tensor(1), torch.tensor([2]), torch.tensor(0), torch.tensor(0), torch.tensor(3)])
    with pytest.raises(splitgrad.DTypeError, match=r"moe.experts.*m_splits\[1\]"):
        layer(x, [1, torch.tensor(2), 0, 0, 3])  # a mix of ints and tensors
    with pytest.raises(splitgrad.ArgumentError, match="moe.experts.*one device"):
        layer(x, [torch.tensor(1), torch.tensor(2, device="meta"), torch.tensor(0), torch.tensor(0),
                  torch.tensor(3)])
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_list_of_0d_cuda_tensors_stays_on_the_device_without_a_sync():
    layer = _layer("cuda")
    counts = torch.tensor([1, 2, 0, 0, 3], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        splits = layer._splits_tensor(list(counts.unbind()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert splits.device.type == "cuda" and splits.tolist() == [1, 2, 0, 0, 3]


def test_a_split_too_large_for_int64_is_a_clear_error():
    np = pytest.importorskip("numpy")
    layer = _layer(n=3, name="moe.experts")
    x = torch.randn(6, IN)
    for m_splits in ([2**70, 2, 2], [2, -(2**63) - 1, 2], np.array([2**63, 2, 2], dtype=np.uint64)):
        with pytest.raises(splitgrad.ArgumentError, match=r"moe.experts.*fit in int64, got m_splits\[\d\]"):
            layer(x, m_splits)
    assert splitgrad.pending_wgrads() == 0


def test_int32_device_splits_are_taken():
    layer = _layer()
    reference = to_reference(layer)
    x, gy = _data([1, 2, 0, 0, 3])
    layer(x, torch.tensor([1, 2, 0, 0, 3], dtype=torch.int32)).backward(gy)
    reference(x, [1, 2, 0, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


def test_bad_input():
    layer = _layer(name="experts")
    with pytest.raises(splitgrad.DTypeError, match=r"expected input of dtype torch.float32 .*got torch.float64"):
        layer(torch.randn(3, IN, dtype=torch.float64), [3, 0, 0, 0, 0])
    with pytest.raises(splitgrad.ArgumentError, match=r"expected input of shape \[\*, 6\]"):
        layer(torch.randn(3, IN + 1), [3, 0, 0, 0, 0])
    with pytest.raises(TypeError, match="expected a torch.Tensor input"):
        layer([1.0], [1, 0, 0, 0, 0])
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(torch.randn(3, IN), [3, 0, 0, 0, 0], is_first_microbatch=1)
    layer.weight1 = nn.Parameter(torch.randn(OUT, IN, dtype=torch.float64))
    with pytest.raises(splitgrad.DTypeError, match=r"expected weight1 of dtype torch.float32 \(weight0's\)"):
        layer(torch.randn(3, IN), [3, 0, 0, 0, 0])
    assert splitgrad.pending_wgrads() == 0


def test_weights_of_different_shapes_name_both():
    """weight0 replaced by one of another shape: the message names both weights' shapes, not only
    the one that differs from weight0."""
    layer = _layer(n=3)
    layer.weight0 = nn.Parameter(torch.randn(OUT + 1, IN))
    with pytest.raises(splitgrad.ArgumentError, match=re.escape(f"expected every weight of one shape, got weight0 "
                                                                f"of shape [{OUT + 1}, {IN}] and weight1 of shape "
                                                                f"[{OUT}, {IN}]")):
        layer(torch.randn(3, IN), [3, 0, 0])


def test_a_deleted_expert_parameter_is_named():
    """del on an expert's parameter: nn.Module would report an AttributeError raised inside a
    property as the property missing ('no attribute use_bias'); the message names the parameter."""
    layer = _layer(n=3)
    del layer.bias0
    assert "bias=True" in repr(layer)
    with pytest.raises(splitgrad.ArgumentError, match="bias for every expert or for none, got bias0 = None"):
        layer(torch.randn(3, IN), [3, 0, 0])
    layer = _layer(n=3)
    del layer.weight1
    with pytest.raises(splitgrad.ArgumentError, match="expected weight1 to be a tensor"):
        layer(torch.randn(3, IN), [3, 0, 0])


def test_constructor_errors():
    with pytest.raises(splitgrad.ArgumentError, match="positive int num_gemms"):
        splitgrad.GroupedLinear(0, IN, OUT, device="cpu")
    with pytest.raises(splitgrad.DTypeError, match="floating-point params_dtype"):
        splitgrad.GroupedLinear(2, IN, OUT, device="cpu", params_dtype=torch.int32)
    with pytest.raises(TypeError, match="tp_size"):
        splitgrad.GroupedLinear(2, IN, OUT, device="cpu", tp_size=2)
    # te.GroupedLinear's parameter order (an optimizer's state saved from TE maps by position)
    assert [n for n, _ in splitgrad.GroupedLinear(3, IN, OUT, device="cpu").named_parameters()] == [
        "weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    for keyword, value in [("save_original_input", True), ("single_grouped_weight", True),
                           ("single_grouped_bias", True), ("use_grouped_tensor", True)]:
        with pytest.raises(TypeError, match=rf"splitgrad.GroupedLinear .*\['{keyword}'\]"):
            splitgrad.GroupedLinear(2, IN, OUT, device="cpu", **{keyword: value})
    # te.GroupedLinear's (TE 2.x) keywords for features splitgrad does not have, at their defaults
    layer = splitgrad.GroupedLinear(2, IN, OUT, device="cpu", tp_size=1, sequence_parallel=False, tp_group=None,
                                    parallel_mode=None, get_rng_state_tracker=None, rng_tracker_name=None,
                                    ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None, return_bias=False,
                                    save_original_input=False, single_grouped_weight=False,
                                    single_grouped_bias=False, use_grouped_tensor=None)
    assert [n for n, _ in layer.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]


def test_sizes_may_be_numpy_integers():
    np = pytest.importorskip("numpy")
    layer = splitgrad.GroupedLinear(np.int64(3), np.int32(IN), OUT, device="cpu")
    assert type(layer.num_gemms) is int and layer.num_gemms == 3 and type(layer.in_features) is int
    assert len(layer.weights) == 3
    layer(torch.randn(4, IN), [1, 0, 3]).sum().backward()
    for bad in (np.float64(3.0), np.bool_(True), True):
        with pytest.raises(splitgrad.ArgumentError, match="positive int num_gemms"):
            splitgrad.GroupedLinear(bad, IN, OUT, device="cpu")


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_return_bias_leaves_the_biases_to_the_caller(delay):
    """te.GroupedLinear's return_bias=True: forward returns (x_i·W_iᵀ, [b_0, ...]); the caller adds
    each expert's bias to its rows, and autograd (not the deferred work) owns the bias gradients.
    Against per-expert nn.Linear without bias, the same bias add done by the caller."""
    splits = [3, 0, 4, 1, 2]
    layer = _layer(return_bias=True, delay_wgrad_compute=delay)
    experts = [nn.Linear(IN, OUT, bias=False) for _ in splits]
    ref_biases = [nn.Parameter(b.detach().clone()) for b in layer.biases]
    with torch.no_grad():
        for expert, weight in zip(experts, layer.weights):
            expert.weight.copy_(weight)
    x, gy = _data(splits)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()

    def add_biases(out, biases):
        return out + torch.stack(list(biases)).repeat_interleave(torch.tensor(splits), dim=0)

    out, biases = layer(xs, splits)
    assert len(biases) == 5 and all(b is p for b, p in zip(biases, layer.biases))
    ref_out = torch.cat([expert(rows) for expert, rows in zip(experts, xr.split(splits))])
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    add_biases(out, biases).backward(gy)
    add_biases(ref_out, ref_biases).backward(gy)
    assert all(b.grad is not None for b in layer.biases)  # at once, by autograd: nothing deferred for them
    if delay:
        assert all(w.grad is None for w in layer.weights)
        layer.backward_dw()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=0)
    for i, (weight, expert) in enumerate(zip(layer.weights, experts)):
        torch.testing.assert_close(weight.grad, expert.weight.grad, rtol=0, atol=0, msg=f"weight{i}")
    for i, (bias, ref) in enumerate(zip(layer.biases, ref_biases)):
        torch.testing.assert_close(bias.grad, ref.grad, rtol=0, atol=0, msg=f"bias{i}")
    out, biases = _layer(return_bias=True, bias=False)(x, splits)
    assert biases == [None] * 5 and out.shape == (sum(splits), OUT)


def test_without_bias_each_bias_is_none():
    """nn.Linear's way: bias{i} reads as None (TE code does getattr(layer, f"bias{i}")); no parameter,
    no state_dict entry."""
    layer = _layer(n=3, bias=False)
    assert all(getattr(layer, f"bias{i}") is None for i in range(3))
    assert layer.biases == [] and not layer.use_bias
    assert [n for n, _ in layer.named_parameters()] == ["weight0", "weight1", "weight2"]
    assert list(layer.state_dict()) == ["weight0", "weight1", "weight2"]
    reference = to_reference(layer)
    x, gy = _data([2, 0, 3])
    layer(x, [2, 0, 3]).backward(gy)
    reference(x, [2, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_biases_assigned_after_bias_false_are_used(delay):
    """nn.Linear(bias=False) uses a bias assigned later; so does every expert here."""
    layer = _layer(n=3, bias=False, delay_wgrad_compute=delay)
    for i in range(3):
        setattr(layer, f"bias{i}", nn.Parameter(torch.randn(OUT)))
    assert layer.use_bias and len(layer.biases) == 3
    reference = to_reference(layer)
    x, gy = _data([2, 0, 3])
    layer(x, [2, 0, 3]).backward(gy)
    reference(x, [2, 0, 3]).backward(gy)
    if delay:
        assert layer.bias0.grad is None
        layer.backward_dw()
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


def test_every_bias_set_to_none_runs_without_bias():
    layer = _layer(n=3)
    for i in range(3):
        setattr(layer, f"bias{i}", None)
    assert layer.biases == [] and not layer.use_bias
    reference = to_reference(layer)
    x, gy = _data([2, 0, 3])
    layer(x, [2, 0, 3]).backward(gy)
    reference(x, [2, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


def test_one_expert_without_bias_or_weight_is_a_clear_error():
    layer = _layer(n=3)
    x, _ = _data([2, 0, 3])
    layer.bias1 = None
    with pytest.raises(splitgrad.ArgumentError, match=r"bias for every expert or for none, got bias1 = None"):
        layer(x, [2, 0, 3])
    layer = _layer(n=3)
    layer.weight2 = None
    with pytest.raises(splitgrad.ArgumentError, match=rf"expected weight2 to be a tensor of shape \[{OUT}, {IN}\], "
                                                      r"got NoneType"):
        layer(x, [2, 0, 3])
    assert splitgrad.pending_wgrads() == 0


def test_backward_dw_with_nothing_pending():
    layer = _layer(delay_wgrad_compute=True, name="moe")
    with pytest.raises(RuntimeError, match="splitgrad layer 'moe': backward_dw\\(\\) was called but no backward pass"):
        layer.backward_dw()
    _layer().backward_dw()  # a regular layer: nothing to do, as in TE


def test_pending_work_guard_names_the_layer():
    layer = _layer(delay_wgrad_compute=True, name="moe.experts")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.randn(6, IN), [6, 0, 0, 0, 0]).sum().backward()
    with pytest.warns(splitgrad.PendingWgradWarning, match="moe.experts"):
        opt.step()
    with pytest.warns(splitgrad.PendingWgradWarning, match="moe.experts"):
        layer.state_dict()
    layer.backward_dw()


def test_deleted_with_work_pending_warns():
    layer = _layer(delay_wgrad_compute=True, name="doomed")
    layer(torch.randn(6, IN), [6, 0, 0, 0, 0]).sum().backward()
    with pytest.warns(splitgrad.PendingWgradWarning, match="doomed"):
        del layer
        import gc

        gc.collect()
    assert splitgrad.pending_wgrads() == 0


# ------------------------------------------------------------------------------------------------
# The operators: opcheck
# ------------------------------------------------------------------------------------------------

ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _op_tensors(bias=True, dtype=torch.float32):
    splits = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4, dtype=dtype)
    ws = [torch.randn(3, 4, dtype=dtype) for _ in range(3)]
    bs = [torch.randn(3, dtype=dtype) for _ in range(3)] if bias else []
    dy = torch.randn(5, 3, dtype=dtype)
    return x, splits, ws, bs, dy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_opcheck_grouped_fprop(bias):
    x, splits, ws, bs, _ = _op_tensors(bias)
    opcheck(ops.grouped_linear_fprop.default, (x, splits, ws, bs), test_utils=ALL_TESTS)


def test_opcheck_grouped_dgrad():
    _, splits, ws, _, dy = _op_tensors()
    opcheck(ops.grouped_linear_dgrad.default, (dy, splits, ws), test_utils=ALL_TESTS)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_opcheck_grouped_wgrad(bias):
    x, splits, _, _, dy = _op_tensors()
    opcheck(ops.grouped_linear_wgrad.default, (dy, x, splits, bias), test_utils=ALL_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_grouped_wgrad_accumulate(dtype):
    x, splits, _, _, dy = _op_tensors(dtype=dtype)
    # No None entries here: PyTorch 2.11's auto_functionalize (test_aot_dispatch_dynamic) fails on
    # a None inside a mutable Tensor?[] ("'dict' object has no attribute 'append'"); eager calls
    # with None entries are tested in test_grouped_wgrad_accumulate_adds.
    weight_grads = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)]
    bias_grads = [torch.randn(3), torch.randn(3), torch.randn(3)]
    opcheck(ops.grouped_linear_wgrad_accumulate_.default, (dy, x, splits, weight_grads, bias_grads),
            test_utils=ALL_TESTS)


def test_grouped_wgrad_accumulate_adds():
    x, splits, _, _, dy = _op_tensors()
    start = [torch.randn(3, 4) for _ in range(3)]
    targets = [t.clone() for t in start]
    bias_start = torch.randn(3)
    bias_target = bias_start.clone()
    ops.grouped_linear_wgrad_accumulate_(dy, x, splits, targets, [None, None, bias_target])
    rows = [(0, 2), (2, 2), (2, 5)]
    for t, s, (a, b) in zip(targets, start, rows):
        torch.testing.assert_close(t, s + dy[a:b].t() @ x[a:b], rtol=0, atol=0)
    torch.testing.assert_close(bias_target, bias_start + dy[2:5].sum(0), rtol=0, atol=0)
    targets = [start[0].clone(), None, None]
    ops.grouped_linear_wgrad_accumulate_(dy, x, splits, targets, [])  # None: that group is skipped
    torch.testing.assert_close(targets[0], start[0] + dy[0:2].t() @ x[0:2], rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_opcheck_grouped_linear(fused):
    x, splits, ws, bs, _ = _op_tensors()
    x.requires_grad_()
    for t in ws + bs:
        t.requires_grad_()
    wmg = [torch.zeros(3, 4) for _ in ws] if fused else []
    bmg = [torch.zeros(3), None, torch.zeros(3)] if fused else []
    opcheck(ops.grouped_linear.default, (x, splits, ws, bs, wmg, bmg, 0, False), test_utils=ALL_TESTS)


def test_opcheck_grouped_linear_delayed():
    """As test_ops.test_opcheck_linear_delayed: the AOT sub-test would queue tracing placeholders."""
    layer = _layer(n=3, delay_wgrad_compute=True)
    x, splits, ws, bs, _ = _op_tensors()
    args = (x.requires_grad_(), splits, [w.requires_grad_() for w in ws], [b.requires_grad_() for b in bs],
            [], [], layer._layer_id, True)
    opcheck(ops.grouped_linear.default, args,
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert splitgrad.pending_wgrads() == 0


def test_compile_fullgraph_regular_forward():
    layer = _layer(n=3)
    reference = to_reference(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x, gy = _data([2, 0, 3])
    splits = torch.tensor([2, 0, 3])
    compiled(x, splits).backward(gy)
    reference(x, [2, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


def test_compile_fullgraph_with_a_routers_counts_as_a_list():
    """te.GroupedLinear's m_splits type, a list of ints, made from a router's counts inside the
    compiled function (counts.tolist(): traced integers, not read while tracing)."""
    layer = _layer(n=3)
    reference = to_reference(layer)

    def step(module, x, choice):
        counts = nn.functional.one_hot(choice, 3).sum(0)
        return module(x[choice.argsort(stable=True)], counts.tolist())

    x, gy = _data([2, 0, 3])
    choice = torch.tensor([2, 0, 2, 0, 2])
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        y = torch.compile(step, fullgraph=True, backend="aot_eager")(layer, x, choice)
    y.backward(gy)
    step(reference, x, choice).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


def test_compile_dynamic_traces_once_for_all_token_counts():
    """A router's token counts change every step: the fake kernels keep the token dimension
    symbolic, so one graph serves them all (as test_workflows' Linear test), not one per count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = _layer(n=3)
    reference = to_reference(layer)
    compiled = torch.compile(layer, dynamic=True, backend="aot_eager")
    for splits in ([2, 0, 3], [4, 1, 0], [1, 7, 9], [0, 0, 6]):
        x, gy = _data(splits)
        layer.zero_grad()
        reference.zero_grad()
        compiled(x, torch.tensor(splits)).backward(gy)
        reference(x, splits).backward(gy)
        _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("delay,fused", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["regular", "delayed", "fused", "delayed-fused"])
@pytest.mark.parametrize("how", ["config", "context"])
def test_compiled_autograd_matches_per_expert_autograd(delay, fused, how):
    """Compiled autograd (torchtitan's option: dynamo's compiled_autograd flag with a compiled
    step, or the context manager) traces the backward: each expert's tensors it reads are lifted
    to its proxies (they were kept in lists it does not look into: an AssertionError)."""
    layer = _layer(n=3, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    if fused:
        for p in layer.weights + layer.biases:
            p.main_grad = torch.zeros(p.shape)
    reference = to_reference(layer)
    x, gy = _data([2, 0, 3])
    backward_under_compiled_autograd(how, lambda: layer(x, [2, 0, 3]).backward(gy))
    layer.backward_dw()
    reference(x, [2, 0, 3]).backward(gy)
    if fused:
        for name, p in layer.named_parameters():
            torch.testing.assert_close(p.main_grad, reference.get_parameter(name).grad, rtol=0, atol=0,
                                       msg=lambda m, name=name: f"{name}.main_grad: {m}")
            assert p.grad is None, name
    else:
        _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


@pytest.mark.filterwarnings("ignore:`torch.jit.(trace|script)` is deprecated:DeprecationWarning")
def test_jit_trace_and_script_are_refused_clearly():
    """The tracer cannot record the grouped op (lists of optional tensors): a clear refusal naming
    the layer, and jit.script's refusal recommends only what works."""
    layer = _layer(n=3, name="experts")
    x, _ = _data([2, 0, 3])
    with pytest.raises(TypeError, match=r"'experts' cannot be recorded by torch.jit.trace .* use torch.export"):
        torch.jit.trace(lambda x: layer(x, [2, 0, 3]), (x,))
    with pytest.raises(TypeError, match=r"'experts' cannot be compiled by torch.jit.script .*torch.compile, or "
                                        r"torch.export, which"):
        torch.jit.script(layer)
    assert splitgrad.pending_wgrads() == 0


def test_export_with_a_dynamic_token_dimension():
    layer = _layer(n=3)
    tokens = torch.export.Dim("tokens", min=2, max=1024)
    exported = torch.export.export(layer, (torch.randn(5, IN), torch.tensor([2, 0, 3])),
                                   dynamic_shapes=({0: tokens}, None))
    for splits in ([4, 1, 4], [0, 11, 2]):
        x = torch.randn(sum(splits), IN)
        torch.testing.assert_close(exported.module()(x, torch.tensor(splits)), layer(x, splits),
                                   rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Property: any routing, tying, micro-batch schedule and W order
# ------------------------------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 4))
    micro = draw(st.integers(1, 3))
    routing = [draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)) for _ in range(micro)]
    tie = draw(st.sampled_from(["none", "experts", "linear"])) if n > 1 else "none"
    # A schedule: forwards in order, each backward after its forward, W steps after their backward.
    order = draw(st.permutations(list(range(micro))))
    w_all = draw(st.booleans())
    return {
        "n": n, "routing": routing, "bias": draw(st.booleans()), "delay": draw(st.booleans()),
        "fused": draw(st.booleans()), "tie": tie, "order": list(order), "w_all": w_all,
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_property_matches_per_expert_autograd(scenario):
    note(str(scenario))
    torch.manual_seed(scenario["seed"])
    n, routing = scenario["n"], scenario["routing"]
    experts = splitgrad.GroupedLinear(n, IN, OUT, bias=scenario["bias"], device="cpu",
                                      delay_wgrad_compute=scenario["delay"],
                                      fuse_wgrad_accumulation=scenario["fused"])
    # A parameter shared by fused and unfused layers would have its gradient split between
    # main_grad and .grad (the caller's choice, as with Linear): the tied Linear is fused alike.
    lin = splitgrad.Linear(IN, OUT, device="cpu", fuse_wgrad_accumulation=scenario["fused"])
    if scenario["fused"]:
        lin.weight.main_grad = torch.zeros(OUT, IN)
    if scenario["tie"] == "experts":
        experts.weight1 = experts.weight0
    elif scenario["tie"] == "linear":
        experts.weight0 = lin.weight
    if scenario["fused"]:
        for p in experts.weights:
            if not hasattr(p, "main_grad"):
                p.main_grad = torch.zeros(p.shape)
    model = nn.ModuleDict({"experts": experts, "lin": lin})
    reference = to_reference(model)
    xs = [torch.randn(sum(s), IN) for s in routing]
    gys = [torch.randn(sum(s), OUT) for s in routing]
    # F0 .. Fk, then the backwards in `order`, W after all (one W step per pass, oldest first).
    tokens = [f"F{i}" for i in range(len(routing))] + [f"B{i}" for i in scenario["order"]]
    tokens += ["Wall"] if scenario["w_all"] else [f"W{i}" for i in scenario["order"]]

    def forward(m, x, i):
        return m["experts"](x, routing[i]) + (m["lin"](x) if scenario["tie"] == "linear" else 0)

    def w_step(token):
        if token == "Wall":
            splitgrad.backward_dw_all()
        elif experts.delay_wgrad_compute:
            experts.backward_dw()

    run_schedule(tokens, model, xs, gys, forward=forward, w_step=w_step)
    run_schedule(tokens, reference, xs, gys, forward=forward)
    assert splitgrad.pending_wgrads() == 0
    contributions = len(routing) * (2 if scenario["tie"] != "none" else 1)
    if contributions <= 2 and not scenario["fused"]:
        _assert_same_grads(model, reference, device="cpu", dtype=torch.float32)
    else:  # three or more terms per gradient (or main_grad's start): association may differ
        assert_grads_match(model, reference, exact=False)


def test_named_and_found_by_the_pipeline_stage_and_fsdp():
    """name_layers names it after its path; the pipeline stage's W steps and splitgrad's
    fully_shard find it among the delayed layers, as they find Linear."""
    from splitgrad import _fsdp, pipelining

    model = nn.Sequential(nn.Tanh(), nn.ModuleDict({"experts": _layer(delay_wgrad_compute=True)}))
    splitgrad.name_layers(model)
    assert model[1]["experts"].name == "1.experts"
    assert pipelining._delayed_layers(model) == [model[1]["experts"]]
    fused = _layer(fuse_wgrad_accumulation=True, name="fused")
    with pytest.raises(ValueError, match="layer 'fused' has fuse_wgrad_accumulation=True"):
        _fsdp.fully_shard(fused)


@pytest.mark.parametrize("fused", [False, True], ids=["delayed", "delayed-fused"])
def test_compile_runs_delayed_layers_eagerly(fused):
    """Under torch.compile a delayed (or fused) layer runs eagerly, so its work is queued with real
    tensors and lands where it should."""
    layer = _layer(n=3, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    if fused:
        for w in layer.weights:
            w.main_grad = torch.zeros(w.shape)
    reference = to_reference(layer)
    compiled = torch.compile(layer, backend="aot_eager")
    x, gy = _data([2, 0, 3])
    compiled(x, [2, 0, 3]).backward(gy)
    reference(x, [2, 0, 3]).backward(gy)
    assert layer.pending_wgrads() == 1
    layer.backward_dw()
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("mode", ["regular", "delayed", "fused"])
def test_autocast_cpu_matches_per_expert_autograd(mode):
    """Under torch.autocast the experts compute in autocast's dtype, as per-expert F.linear does:
    the input is cast, the weights for the product only, and their gradients land in their own
    dtype. Regular and delayed .grad take autograd's arithmetic (the bf16 gradient cast to fp32):
    bit for bit; main_grad adds the product in fp32 without rounding it to bf16 first: close."""
    layer = _layer(n=3, delay_wgrad_compute=mode != "regular", fuse_wgrad_accumulation=mode == "fused")
    if mode == "fused":
        for p in layer.weights + layer.biases:
            p.main_grad = torch.zeros(p.shape)
    reference = to_reference(layer)
    splits = [3, 0, 4]
    x, gy = _data(splits)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = layer(x, splits), reference(x, splits)
        # an activation already in bf16 is taken as it is, as F.linear takes it
        y_bf16 = layer(x.bfloat16(), splits)
    assert y.dtype == y_ref.dtype == y_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(y_bf16, y_ref, rtol=0, atol=0)
    y.backward(gy.bfloat16())
    y_ref.backward(gy.bfloat16())
    (y_bf16 * 0).sum().backward()  # adds zeros: the comparison below is unchanged
    layer.backward_dw()
    layer.backward_dw()
    for p in layer.parameters():
        assert (p.main_grad if mode == "fused" else p.grad).dtype == torch.float32
    if mode == "fused":
        for (name, p), p_ref in zip(layer.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.main_grad, p_ref.grad, rtol=1e-2, atol=1e-2, msg=lambda m: f"{name}: {m}")
    else:
        _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
    with pytest.raises(splitgrad.DTypeError, match=r"expected input of dtype torch.float32 \(the weight's dtype\)"):
        layer(x.bfloat16(), splits)  # outside autocast


@pytest.mark.parametrize("delay,fused", [(False, False), (True, False), (True, True)])
def test_torch_func_transforms_match_per_expert_linear(delay, fused):
    """Under torch.func transforms and forward-mode AD each expert computes with F.linear, as a
    per-expert plain model does: the gradients are returned, exact; nothing is queued or written."""
    layer = splitgrad.GroupedLinear(3, 4, 5, device="cpu", delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    if fused:
        for p in layer.parameters():
            p.main_grad = torch.zeros_like(p)
    splits = [2, 0, 3]
    x = torch.randn(5, 4)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def plain(p, x):
        pieces = x.split(splits)
        return torch.cat([nn.functional.linear(pieces[i], p[f"weight{i}"], p[f"bias{i}"]) for i in range(3)])

    def mine(p, x):
        return torch.func.functional_call(layer, p, (x, splits))

    def exact(a, b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    exact(torch.func.grad(lambda p, x: mine(p, x).pow(2).sum())(params, x),
          torch.func.grad(lambda p, x: plain(p, x).pow(2).sum())(params, x))
    exact(torch.func.jacrev(mine, argnums=1)(params, x), torch.func.jacrev(plain, argnums=1)(params, x))
    tangent = torch.randn_like(x)
    exact(torch.func.jvp(lambda x: mine(params, x), (x,), (tangent,)),
          torch.func.jvp(lambda x: plain(params, x), (x,), (tangent,)))
    assert splitgrad.pending_wgrads() == 0
    assert all(p.grad is None for p in layer.parameters())
    with pytest.raises(splitgrad.ArgumentError, match="expected m_splits to sum to the input's 5 rows"):
        torch.func.grad(lambda x: layer(x, [1, 1, 1]).sum())(x)


@pytest.mark.parametrize("how", ["grad", "forward_ad"])
def test_argument_checks_under_transforms_name_the_layer_as_eager_ones(how):
    """Under torch.func transforms and forward-mode AD the layer runs without its op; its argument
    checks run still, with the messages and types of the eager path."""
    layer = splitgrad.GroupedLinear(3, 4, 5, device="cpu", name="experts")
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def run(x, splits, p=params):
        if how == "grad":
            return torch.func.grad(lambda x: torch.func.functional_call(layer, p, (x, splits)).sum())(x)
        with torch.autograd.forward_ad.dual_level():
            return layer(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)), splits)

    cases = [
        # 18 elements: a reshape to [-1, 4] must not be what reports it
        (lambda: run(torch.randn(6, 3), [2, 1, 3]), splitgrad.ArgumentError,
         r"'experts': expected input of shape \[\*, 4\] \(in_features = 4\), got shape \[6, 3\]"),
        (lambda: run(torch.randn(5, 4, dtype=torch.float64), [2, 0, 3]), splitgrad.DTypeError,
         r"'experts': expected input of dtype torch.float32 \(the weight's dtype\), got torch.float64"),
        (lambda: run(torch.randn(5, 4), [2, -1, 4]), splitgrad.ArgumentError,
         r"'experts': expected non-negative m_splits, got m_splits\[1\] = -1"),
        (lambda: run(torch.randn(5, 4), [2, 3]), splitgrad.ArgumentError,
         r"'experts': expected 3 splits \(one per group\)"),
    ]
    if how == "grad":
        bad = dict(params, weight1=torch.randn(5, 3))
        cases.append((lambda: run(torch.randn(5, 4), [2, 0, 3], bad), splitgrad.ArgumentError,
                      r"'experts': expected every weight of one shape, got weight0 of shape \[5, 4\] and "
                      r"weight1 of shape \[5, 3\]"))
        bad_bias = dict(params, bias2=torch.randn(4))
        cases.append((lambda: run(torch.randn(5, 4), [2, 0, 3], bad_bias), splitgrad.ArgumentError,
                      r"'experts': expected bias2 of shape \[5\], got shape \[4\]"))
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.parametrize("shape", [(6, 0), (2, 3, 0)])
def test_substituted_weights_without_in_features_under_a_transform_give_the_eager_result(shape):
    """Weights of no in_features substituted by functional_call: the products are the biases, as
    eager; under a transform too (the splits' check computed the rows by a division by 0)."""
    layer = splitgrad.GroupedLinear(3, 4, 5, device="cpu")
    params = {k: (torch.zeros(5, 0) if k.startswith("weight") else v.detach()) for k, v in layer.named_parameters()}
    x = torch.randn(*shape)

    def loss(x):
        return torch.func.functional_call(layer, params, (x, [2, 1, 3])).pow(2).sum()

    eager = torch.func.functional_call(layer, params, (x, [2, 1, 3]))
    want = torch.cat([params[f"bias{i}"].expand(n, 5) for i, n in enumerate([2, 1, 3])]).reshape(*shape[:-1], 5)
    torch.testing.assert_close(eager, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.func.grad(loss)(x), torch.zeros(shape), rtol=0, atol=0)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(
            torch.func.functional_call(layer, params, (dual, [2, 1, 3]))).primal, want, rtol=0, atol=0)


@pytest.mark.parametrize("delay,fused", [(False, False), (True, False), (True, True)])
def test_batched_backward_matches_per_expert_linear(delay, fused):
    """autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) run the backward under
    vmap (which cannot batch the grouped ops' tensor lists): gradients as a per-expert nn.Linear
    model's, returned (input and expert weights), nothing queued or written."""
    layer = _layer(delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused, n=3)
    if fused:
        for p in layer.parameters():
            p.main_grad = torch.zeros_like(p)
    reference = to_reference(layer)
    splits = [2, 0, 3]
    x = torch.randn(5, IN, requires_grad=True)
    vectors = torch.randn(4, 5, OUT)
    wanted = [x, layer.weight0, layer.bias2]
    got = torch.autograd.grad(layer(x, splits), wanted, vectors, is_grads_batched=True)
    want = torch.autograd.grad(reference(x, splits), [x, reference.weight0, reference.bias2], vectors,
                               is_grads_batched=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.autograd.functional.jacobian(lambda t: layer(t, splits), x, vectorize=True),
        torch.autograd.functional.jacobian(lambda t: reference(t, splits), x, vectorize=True), rtol=0, atol=0)
    assert splitgrad.pending_wgrads() == 0
    assert all(p.grad is None for p in layer.parameters())
    if fused:
        assert all(not p.main_grad.any() for p in layer.parameters())


def test_fused_experts_differentiated_inside_a_transform_say_where_the_gradient_goes():
    """As splitgrad.Linear: a fused layer's own parameters differentiated through a torch.func
    transform get plain autograd's gradient in .grad (the transform runs F.linear): a warning
    says so, and .grad + main_grad is plain autograd's."""
    layer = splitgrad.GroupedLinear(2, 4, 5, device="cpu", fuse_wgrad_accumulation=True, name="experts")
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p)
    reference = to_reference(layer)
    x = torch.randn(7, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="'experts' .* adds its gradient to each expert's weight\\{i\\}.grad, "
                                         "not main_grad"):
        torch.func.grad(lambda x: layer(x, [3, 4]).pow(2).sum())(x).sum().backward()
    torch.func.grad(lambda x: reference(x, [3, 4]).pow(2).sum())(x).sum().backward()
    for (name, p), ref in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.main_grad + p.grad, ref.grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_routers_counts_buffer_refilled_before_the_backward(delay, dtype):
    """A per-expert model splits its rows at the forward: refilling the router's counts buffer
    for the next micro-batch before this one's backward (and backward_dw) changes nothing."""
    layer = _layer(n=3, delay_wgrad_compute=delay)
    reference = to_reference(layer)
    x, gy = _data([2, 0, 3])
    counts = torch.tensor([2, 0, 3], dtype=dtype)
    y = layer(x, counts)
    counts.copy_(torch.tensor([1, 3, 1]))
    y.backward(gy)
    counts.copy_(torch.tensor([0, 0, 5]))
    layer.backward_dw()
    reference(x, [2, 0, 3]).backward(gy)
    _assert_same_grads(layer, reference, device="cpu", dtype=torch.float32)
