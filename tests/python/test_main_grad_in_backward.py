"""fuse_wgrad_accumulation reads each parameter's main_grad in the backward, where Transformer
Engine reads it (``ctx.main_grad_func()``), not in the forward:

- a Megatron-FSDP parameter (``__fsdp_param__``) has no main_grad in the forward; the backward gets
  it from ``param.get_main_grad()``, which allocates it then;
- a main_grad replaced between the forward and the backward receives the gradient (the old one
  nothing);
- one removed or broken by then is a clear error in the backward, with nothing queued or written.

Every module against its plain-autograd twin (sg_helpers.to_reference) on the same weights.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from sg_helpers import make_data, run_schedule, to_reference

IN, OUT, EXPERTS = 6, 4, 3
SPLITS = [2, 0, 3]  # an expert without rows still gets its (zero) gradient in main_grad

KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"]


def build(kind: str, delay: bool) -> torch.nn.Module:
    kw = dict(delay_wgrad_compute=delay, fuse_wgrad_accumulation=True, device="cpu", name=kind.lower())
    if kind == "Linear":
        return splitgrad.Linear(IN, OUT, **kw)
    if kind == "LayerNormLinear":
        return splitgrad.LayerNormLinear(IN, OUT, **kw)
    if kind == "LayerNormMLP":
        return splitgrad.LayerNormMLP(IN, 2 * IN, **kw)
    return splitgrad.GroupedLinear(EXPERTS, IN, OUT, **kw)


def forward_of(kind: str):
    if kind == "GroupedLinear":
        return lambda model, x, i: model(x, SPLITS)
    return None


def gemm_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters whose gradient the GEMMs fuse into main_grad (not the norms')."""
    return {name: p for name, p in model.named_parameters() if not name.startswith("layer_norm")}


def w_step(model):
    return (lambda token: model.backward_dw()) if model.delay_wgrad_compute else None


class MegatronFSDPMainGrads:
    """Megatron-FSDP's contract as TE sees it: a parameter marked ``__fsdp_param__`` whose
    ``get_main_grad()`` allocates its fp32 gradient buffer on first use (before the backward)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.calls = 0
        for name, p in params.items():
            p.__fsdp_param__ = True
            p.get_main_grad = lambda name=name, p=p: self.get(name, p)

    def get(self, name: str, p: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if name not in self.buffers:
            self.buffers[name] = torch.zeros(p.shape, dtype=torch.float32)
        return self.buffers[name]


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
@pytest.mark.parametrize("kind", KINDS)
def test_megatron_fsdp_main_grad_allocated_in_the_backward(kind, delay):
    model = build(kind, delay)
    reference = to_reference(model)
    params = gemm_parameters(model)
    lazy = MegatronFSDPMainGrads(params)
    for p in params.values():
        p.grad_added_to_main_grad = False
    xs, gys = make_data(2, (5, IN), OUT if kind != "LayerNormMLP" else IN)
    forward = forward_of(kind)

    outs = [model(x, SPLITS) if kind == "GroupedLinear" else model(x) for x in xs]
    assert lazy.calls == 0, "the forward must not allocate Megatron-FSDP's main_grad"
    for out, gy in zip(outs, gys):
        out.backward(gy)
    assert lazy.calls > 0, "the backward reads main_grad through get_main_grad()"
    if delay:
        model.backward_dw()
        model.backward_dw()
    run_schedule("F0 B0 F1 B1", reference, xs, gys, forward=forward)

    ref_params = dict(reference.named_parameters())
    assert set(lazy.buffers) == set(params), "every GEMM parameter got its main_grad"
    for name, p in params.items():
        assert p.grad is None, f"{name}: fused into main_grad, .grad stays None"
        assert p.grad_added_to_main_grad is True
        # main_grad += dW0, += dW1 in fp32 as the reference's .grad: bit for bit
        torch.testing.assert_close(lazy.buffers[name], ref_params[name].grad, rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    for name, p in model.named_parameters():
        if name not in params:  # the norms' gradients go to .grad, as without Megatron-FSDP
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=0, atol=0)


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
@pytest.mark.parametrize("kind", KINDS)
def test_main_grad_replaced_after_the_forward_gets_the_gradient(kind, delay):
    model = build(kind, delay)
    params = gemm_parameters(model)
    for p in params.values():
        p.main_grad = torch.zeros(p.shape)
    reference = to_reference(model)
    old = {name: p.main_grad for name, p in params.items()}
    (x,), (gy,) = make_data(1, (5, IN), OUT if kind != "LayerNormMLP" else IN)
    out = model(x, SPLITS) if kind == "GroupedLinear" else model(x)
    for p in params.values():
        p.main_grad = torch.full(p.shape, 0.5)  # e.g. a gradient buffer swapped between steps
    out.backward(gy)
    if delay:
        model.backward_dw()
    ref_out = reference(x, SPLITS) if kind == "GroupedLinear" else reference(x)
    ref_out.backward(gy)
    ref_params = dict(reference.named_parameters())
    for name, p in params.items():
        assert torch.count_nonzero(old[name]) == 0, f"{name}: the main_grad of the forward got a gradient"
        torch.testing.assert_close(p.main_grad, 0.5 + ref_params[name].grad, rtol=1.3e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("broken", ["removed", "wrong-shape", "bf16", "not-a-tensor", "overlapping"])
def test_main_grad_broken_before_the_backward_is_a_clear_error(kind, delay, broken):
    model = build(kind, delay)
    params = gemm_parameters(model)
    for p in params.values():
        p.main_grad = torch.zeros(p.shape)
    # the weight of the GEMM whose backward runs first (LayerNormMLP: fc2), so that no other GEMM
    # of the pass has queued or written anything before the error
    weight = params["fc2_weight"] if kind == "LayerNormMLP" else next(iter(params.values()))
    (x,), (gy,) = make_data(1, (5, IN), OUT if kind != "LayerNormMLP" else IN)
    out = model(x, SPLITS) if kind == "GroupedLinear" else model(x)
    if broken == "removed":
        del weight.main_grad
        named = "fc2_weight" if kind == "LayerNormMLP" else "weight0" if kind == "GroupedLinear" else "weight"
        error, match = ValueError, rf"needs {named}\.main_grad.*not set"
    elif broken == "wrong-shape":
        weight.main_grad = torch.zeros(weight.shape[0] + 1, weight.shape[1])
        error, match = ValueError, r"main_grad of shape"
    elif broken == "bf16":
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.bfloat16)
        error, match = ValueError, r"main_grad of dtype torch.float32, got torch.bfloat16"
    elif broken == "overlapping":
        weight.main_grad = torch.zeros(1, weight.shape[1]).expand(weight.shape)
        error, match = ValueError, r"main_grad whose elements each have memory of their own .*strides \[0, 1\]"
    else:
        weight.main_grad = [0.0]
        error, match = TypeError, r"main_grad to be a torch.Tensor, got list"
    with pytest.raises(error, match=match) as raised:
        out.backward(gy)
    if broken != "not-a-tensor":
        assert f"'{model.name}'" in str(raised.value), "the error names the layer"
    assert splitgrad.pending_wgrads() == 0, "nothing is queued"
    for name, p in params.items():
        assert p.grad is None
        if isinstance(getattr(p, "main_grad", None), torch.Tensor):
            assert torch.count_nonzero(p.main_grad) == 0, f"{name}: nothing is written"


def test_get_main_grad_error_reaches_the_caller_unchanged():
    layer = build("Linear", True)

    class BucketReleased(Exception):
        pass

    def get_main_grad():
        raise BucketReleased("the gradient bucket is gone")

    for p in (layer.weight, layer.bias):
        p.__fsdp_param__ = True
        p.get_main_grad = get_main_grad
    out = layer(torch.randn(3, IN))
    with pytest.raises(BucketReleased, match="the gradient bucket is gone"):
        out.sum().backward()
    assert splitgrad.pending_wgrads() == 0


def test_bias_without_main_grad_in_the_backward_goes_to_grad():
    """As te.Linear: a bias without main_grad (at the time of the backward) gets .grad."""
    layer = build("Linear", True)
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    layer.bias.main_grad = torch.zeros(layer.bias.shape)
    reference = to_reference(layer)
    (x,), (gy,) = make_data(1, (5, IN), OUT)
    out = layer(x)
    del layer.bias.main_grad
    out.backward(gy)
    layer.backward_dw()
    reference(x).backward(gy)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.main_grad, reference.weight.grad, rtol=0, atol=0)


def test_op_refuses_main_grads_with_lazy_main_grad():
    x, w = torch.randn(3, IN), torch.randn(OUT, IN, requires_grad=True)
    with pytest.raises(ValueError, match="lazy_main_grad=True reads the main_grads in the backward"):
        torch.ops.splitgrad.linear(x, w, None, torch.zeros(OUT, IN), None, 0, False, None, True)
    splits = torch.tensor([3])
    with pytest.raises(ValueError, match="lazy_main_grad=True reads the main_grads in the backward"):
        torch.ops.splitgrad.grouped_linear(x, splits, [w], [], [torch.zeros(OUT, IN)], [], 0, False, True)
