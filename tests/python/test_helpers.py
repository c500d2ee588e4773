"""The comparison helpers must be able to fail: a reference that keeps tying and pre-existing
gradients, and a comparison that catches a lost contribution (Transformer Engine's bug) in every
mode (exact, float32 tolerance, low precision against float64)."""

import pytest
import torch
from torch import nn

import splitgrad
from sg_helpers import RefLinear, assert_grads_match, make_data, to_reference


def tied_model(dtype=torch.float32, delay=True):
    model = nn.Sequential(
        splitgrad.Linear(8, 8, device="cpu", params_dtype=dtype, delay_wgrad_compute=delay), nn.Tanh(),
        splitgrad.Linear(8, 8, device="cpu", params_dtype=dtype, delay_wgrad_compute=delay))
    model[2].weight = model[0].weight
    return model


def test_reference_is_plain_autograd_with_the_same_tying_and_grads():
    model = tied_model()
    model[0].bias.grad = torch.randn(8)
    reference = to_reference(model)
    assert isinstance(reference[0], RefLinear) and isinstance(reference[0], nn.Linear)
    assert not any(isinstance(m, splitgrad.Linear) for m in reference.modules())
    assert reference[2].weight is reference[0].weight
    assert reference[0].weight is not model[0].weight
    assert torch.equal(reference[0].weight, model[0].weight)
    assert torch.equal(reference[0].bias.grad, model[0].bias.grad)
    assert reference[0].bias.grad.data_ptr() != model[0].bias.grad.data_ptr()
    high = to_reference(model, torch.float64)
    assert high[0].weight.dtype == torch.float64 and high[2].weight is high[0].weight
    assert high[0].bias.grad.dtype == torch.float64


def _lose_a_contribution(model, x, gy):
    """What Transformer Engine did: each layer's deferred wgrad *assigns* the shared gradient."""
    model(x).backward(gy)
    model[0].backward_dw()
    first = model[0].weight.grad.clone()
    model[0].weight.grad = None
    model[2].backward_dw()
    return first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
def test_comparison_catches_a_lost_contribution(dtype):
    model = tied_model(dtype)
    reference = to_reference(model)
    high = to_reference(model, torch.float64)
    (x,), (gy,) = make_data(1, (4, 8), 8, dtype=dtype)
    _lose_a_contribution(model, x, gy)
    reference(x).backward(gy)
    high(x.double()).backward(gy.double())
    modes = [False] + ([True] if dtype == torch.float32 else [])
    for exact in modes:
        with pytest.raises(AssertionError, match="weight"):
            assert_grads_match(model, reference, exact=exact, high_precision=high)


def test_exact_comparison_catches_one_ulp():
    model = tied_model(delay=False)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (4, 8), 8)
    model(x).backward(gy)
    reference(x).backward(gy)
    assert_grads_match(model, reference, exact=True)
    g = model[0].bias.grad
    g[0] = torch.nextafter(g[0], torch.tensor(float("inf")))
    assert_grads_match(model, reference, exact=False)
    with pytest.raises(AssertionError, match="0.bias"):
        assert_grads_match(model, reference, exact=True)


def test_comparison_catches_a_missing_gradient():
    model = tied_model(delay=False)
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (4, 8), 8)
    model(x).backward(gy)
    reference(x).backward(gy)
    model[2].bias.grad = None
    with pytest.raises(AssertionError, match="2.bias"):
        assert_grads_match(model, reference, exact=False)


def test_low_precision_comparison_needs_a_float64_reference():
    model = tied_model(torch.bfloat16, delay=False)
    reference = to_reference(model)
    high = to_reference(model, torch.float64)
    (x,), (gy,) = make_data(1, (4, 8), 8, dtype=torch.bfloat16)
    model(x).backward(gy)
    reference(x).backward(gy)
    high(x.double()).backward(gy.double())
    with pytest.raises(AssertionError, match="float64 reference"):
        assert_grads_match(model, reference, exact=False)
    assert_grads_match(model, reference, exact=False, high_precision=high)
