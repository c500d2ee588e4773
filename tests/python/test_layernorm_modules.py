"""splitgrad.LayerNormLinear and splitgrad.LayerNormMLP against plain PyTorch (F.layer_norm /
F.rms_norm, F.linear and the activation, with the same parameters): every normalization,
activation, zero-centred gamma, return_layernorm_output, bias or not, fp32/bf16, delayed and
immediate wgrad, micro-batches in any W order, tying, fused main_grad, hooks, misuse, and the
torch.export / torch.compile / torch.func paths. On the CPU the arithmetic is plain autograd's, so
the comparisons are bit for bit (rtol = atol = 0)."""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import splitgrad
from sg_helpers import (DEVICES, NO_CUDA, assert_grads_match, backward_dw_each, named_gradients, ref_activation,
                        run_schedule, to_reference, unwritable_grad)

ACTIVATIONS = ["gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu", "qgeglu", "sreglu", "glu"]
NORMS = ["LayerNorm", "RMSNorm"]
DTYPES = [torch.float32, torch.bfloat16]
H, FFN, OUT = 8, 12, 6


def make(kind: str, **kw):
    kw.setdefault("device", "cpu")
    if kind == "linear":
        return splitgrad.LayerNormLinear(H, OUT, **kw)
    return splitgrad.LayerNormMLP(H, FFN, **kw)


def randomize(module: nn.Module, seed: int = 1) -> None:
    """Non-trivial norm parameters (the defaults are 1 and 0), so that their gradients matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def loss_of(out) -> torch.Tensor:
    """Every output counts (ln_out too, when returned), each with its own weight."""
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.float() * (k + 1) * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() for k, o in enumerate(outs))


def assert_same(model: nn.Module, reference: nn.Module, case: str = "") -> None:
    """Every gradient of ``model`` equals ``reference``'s bit for bit."""
    got, want = named_gradients(model), named_gradients(reference)
    assert list(got) == list(want)
    for name in got:
        assert (got[name] is None) == (want[name] is None), f"{case} {name}"
        if got[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{case} {name}: {m}")


def exact_step(model, x, *, delay: bool):
    """Forward, backward and (for a delayed module) backward_dw; returns the outputs and x.grad."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    loss_of(out).backward()
    if delay:
        assert splitgrad.pending_wgrads() == model.pending_wgrads() > 0
        model.backward_dw()
    assert splitgrad.pending_wgrads() == 0
    return out, x.grad


# 1. Against plain PyTorch, every option -------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("kind,activation", [("linear", None)] + [("mlp", a) for a in ACTIVATIONS])
def test_matches_plain_pytorch(kind, activation, normalization, dtype):
    """Each of zero_centered_gamma, return_layernorm_output and bias on and off, delayed and
    immediate: outputs, the input's and every parameter's gradient bit for bit."""
    kw = dict(activation=activation) if activation else {}
    for zero_centered, return_ln, bias, delay in itertools.product([False, True], repeat=4):
        case = f"zero_centered_gamma={zero_centered} return_layernorm_output={return_ln} bias={bias} delay={delay}"
        model = make(kind, bias=bias, normalization=normalization, zero_centered_gamma=zero_centered,
                     return_layernorm_output=return_ln, params_dtype=dtype, delay_wgrad_compute=delay, **kw)
        randomize(model)
        reference = to_reference(model)
        x = torch.randn(2, 3, H).to(dtype)
        out, dx = exact_step(model, x, delay=delay)
        ref_out, ref_dx = exact_step(reference, x, delay=False)
        assert isinstance(out, tuple) == return_ln, case
        for got, want in zip(out if return_ln else (out,), ref_out if return_ln else (ref_out,)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0, msg=lambda m: f"{case}, input grad: {m}")
        assert_same(model, reference, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("normalization", NORMS)
def test_zero_centered_gamma_adds_the_one_in_fp32(normalization, dtype, device):
    """TE's numerics for a 16-bit zero-centred gamma: 1 + gamma is formed in fp32 inside the norm,
    which runs in fp32 and rounds its output once. Against a float64 computation rounded to the
    dtype, the norm's output and the input's gradient agree but for the odd tie (< 1 %); with
    1 + gamma rounded to 16 bits first, a quarter of them differ (checked here too, so the data
    can tell the two apart)."""
    hidden, rows = 256, 64
    model = splitgrad.LayerNormLinear(hidden, 16, normalization=normalization, zero_centered_gamma=True,
                                      return_layernorm_output=True, params_dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in (model.layer_norm_weight, model.layer_norm_bias):
            if param is not None:
                param.copy_(torch.randn(hidden, generator=generator) * 0.1)
    x = torch.randn(rows, hidden, generator=generator).to(dtype=dtype, device=device)
    gy = torch.randn(rows, hidden, generator=generator).to(dtype=dtype, device=device)

    def norm_and_dx(inp, gamma, beta):
        inp = inp.detach().requires_grad_(True)
        if normalization == "LayerNorm":
            out = nn.functional.layer_norm(inp, (hidden,), gamma, beta, model.eps)
        else:
            out = nn.functional.rms_norm(inp, (hidden,), gamma, model.eps)
        (out.double() * gy.double()).sum().backward()
        return out, inp.grad

    xg = x.clone().requires_grad_(True)
    _, ln_out = model(xg)
    (ln_out.double() * gy.double()).sum().backward()
    weight, bias = model.layer_norm_weight.detach(), model.layer_norm_bias
    bias = bias.detach() if bias is not None else None
    exact, exact_dx = norm_and_dx(x.double(), weight.double() + 1, bias.double() if bias is not None else None)
    rounded, rounded_dx = norm_and_dx(x, weight + 1, bias)  # 1 + gamma rounded to dtype

    def differing(got, want):
        return (got != want.to(dtype)).float().mean().item()

    # (CUDA's fp32 norm rounds a little more than the CPU's: near a tie it may land on the other side)
    assert differing(ln_out, exact) < 1e-2 and differing(xg.grad, exact_dx) < 1e-2
    assert differing(rounded, exact) > 0.1 and differing(rounded_dx, exact_dx) > 0.1


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_matches_torch_nn_modules(normalization, activation):
    """The same block from torch.nn modules (nn.LayerNorm / nn.RMSNorm, nn.Linear, the activation)."""
    model = make("mlp", normalization=normalization, activation=activation, delay_wgrad_compute=True)
    randomize(model)
    norm = (nn.LayerNorm(H) if normalization == "LayerNorm" else nn.RMSNorm(H, eps=1e-5))
    fc1 = nn.Linear(H, model.fc1_weight.shape[0])
    fc2 = nn.Linear(FFN, H)
    with torch.no_grad():
        norm.weight.copy_(model.layer_norm_weight)
        if normalization == "LayerNorm":
            norm.bias.copy_(model.layer_norm_bias)
        for lin, w, b in ((fc1, model.fc1_weight, model.fc1_bias), (fc2, model.fc2_weight, model.fc2_bias)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    x = torch.randn(4, H)
    out, dx = exact_step(model, x, delay=True)
    xr = x.clone().requires_grad_(True)
    ref = fc2(ref_activation(activation, fc1(norm(xr))))
    loss_of(ref).backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, xr.grad, rtol=0, atol=0)
    pairs = [(model.layer_norm_weight, norm.weight), (model.fc1_weight, fc1.weight), (model.fc1_bias, fc1.bias),
             (model.fc2_weight, fc2.weight), (model.fc2_bias, fc2.bias)]
    if normalization == "LayerNorm":
        pairs.append((model.layer_norm_bias, norm.bias))
    for got, want in pairs:
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_gated_activation_gates_the_first_half_and_gelu_is_tanh():
    """TE's conventions: swiglu(a, b) = silu(a) * b for fc1's output [a | b]; "gelu" is tanh-GELU."""
    model = make("mlp", activation="swiglu", bias=False)
    nn.init.eye_(model.fc2_weight)  # fc2 = identity on the first H of FFN features
    x = torch.randn(5, H)
    with torch.no_grad():
        h = nn.functional.linear(nn.functional.layer_norm(x, (H,)), model.fc1_weight)
        a, b = h[:, :FFN], h[:, FFN:]
        torch.testing.assert_close(model(x), (nn.functional.silu(a) * b)[:, :H], rtol=0, atol=0)
    gelu = make("mlp", activation="gelu", bias=False)
    nn.init.eye_(gelu.fc2_weight)
    with torch.no_grad():
        h = nn.functional.linear(nn.functional.layer_norm(x, (H,)), gelu.fc1_weight)
        torch.testing.assert_close(gelu(x), nn.functional.gelu(h, approximate="tanh")[:, :H], rtol=0, atol=0)
        assert not torch.equal(gelu(x), nn.functional.gelu(h)[:, :H])


class _CountCalls(nn.Module):
    """A parametrization that counts its evaluations."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return weight * 1.0


def _parametrized_calls(module: nn.Module, name: str, forward) -> int:
    counter = _CountCalls()
    parametrize.register_parametrization(module, name, counter)
    counter.calls = 0  # registering evaluates it once
    forward(module)
    return counter.calls


@pytest.mark.parametrize("return_bias", [False, True])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("kind,name", [("linear", "weight"), ("linear", "bias"), ("mlp", "fc1_weight"),
                                       ("mlp", "fc1_bias"), ("mlp", "fc2_weight"), ("mlp", "fc2_bias"),
                                       ("linear", "layer_norm_weight"), ("linear", "layer_norm_bias"),
                                       ("mlp", "layer_norm_weight")])
def test_a_parametrized_parameter_is_evaluated_once_per_forward(kind, name, delay, return_bias):
    """As nn.Linear reads its weight once per forward (a parametrization's power iteration or
    sampling runs once); the norm's input checks must not read the GEMM's weight a second time,
    nor the path's choice (forward-mode tangents) the norm's parameters."""
    x = torch.randn(3, H)
    expected = _parametrized_calls(nn.Linear(H, OUT), "weight", lambda m: m(x))
    assert expected == 1
    model = make(kind, delay_wgrad_compute=delay, return_bias=return_bias)
    assert _parametrized_calls(model, name, lambda m: loss_of(m(x)).backward()) == expected
    splitgrad.backward_dw_all()


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("kind,name", [("linear", "weight"), ("mlp", "fc1_weight"), ("mlp", "fc2_weight")])
def test_spectral_norm_matches_plain_pytorch(kind, name, delay):
    """spectral_norm's power iteration advances u once per training forward: after three steps u,
    the outputs and every gradient (parametrizations.<name>.original's included) equal the
    plain-PyTorch twin's (F.layer_norm / F.linear, the same parametrization) bit for bit."""
    model = make(kind, delay_wgrad_compute=delay)
    randomize(model)
    reference = to_reference(model)
    for module in (model, reference):
        torch.manual_seed(5)
        nn.utils.parametrizations.spectral_norm(module, name)
    for step in range(3):
        x = torch.randn(2, 3, H)
        out, dx = exact_step(model, x, delay=delay)
        ref_out, ref_dx = exact_step(reference, x, delay=False)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0, msg=lambda m: f"step {step} output: {m}")
        torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0, msg=lambda m: f"step {step} input grad: {m}")
    for buffer in ("_u", "_v"):
        torch.testing.assert_close(getattr(model.parametrizations[name][0], buffer),
                                   getattr(reference.parametrizations[name][0], buffer), rtol=0, atol=0)
    assert f"parametrizations.{name}.original" in named_gradients(model)
    assert_same(model, reference)


# 2. Parameters, keywords, return values ---------------------------------------------------------

def test_te_parameter_names_shapes_and_initialisation():
    ln = make("linear")
    assert [n for n, _ in ln.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    assert make("linear", normalization="RMSNorm", bias=False).layer_norm_bias is None
    assert [n for n, _ in make("linear", normalization="RMSNorm", bias=False).named_parameters()] == [
        "layer_norm_weight", "weight"]
    mlp = make("mlp", activation="swiglu")
    assert [n for n, _ in mlp.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    assert mlp.fc1_weight.shape == (2 * FFN, H) and mlp.fc1_bias.shape == (2 * FFN,)
    assert mlp.fc2_weight.shape == (H, FFN) and mlp.fc2_bias.shape == (H,)
    assert make("mlp").fc1_weight.shape == (FFN, H)
    assert torch.equal(ln.layer_norm_weight, torch.ones(H)) and torch.equal(ln.layer_norm_bias, torch.zeros(H))
    assert torch.equal(make("mlp", zero_centered_gamma=True).layer_norm_weight, torch.zeros(H))
    assert make("linear", params_dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    seen = []
    make("mlp", init_method=lambda w: seen.append(("fc1", tuple(w.shape))),
         output_layer_init_method=lambda w: seen.append(("fc2", tuple(w.shape))))
    assert seen == [("fc1", (FFN, H)), ("fc2", (H, FFN))]


def test_te_keywords_at_their_defaults_are_accepted_others_refused():
    make("linear", sequence_parallel=False, tp_size=1, parallel_mode=None, ub_overlap_rs_dgrad=False,
         return_layernorm_output_gathered=False, parameters_split=None, symmetric_ar_type=None)
    make("mlp", sequence_parallel=False, tp_group=None, set_parallel_mode=False, seq_length=None,
         micro_batch_size=None, activation_params=None, checkpoint=False, ub_bulk_wgrad=False)
    with pytest.raises(TypeError, match=r"splitgrad.LayerNormLinear: sequence parallelism is not supported"):
        make("linear", sequence_parallel=True)
    with pytest.raises(TypeError, match=r"splitgrad.LayerNormMLP .*\['parallel_mode'\]"):
        make("mlp", parallel_mode="column")  # te.LayerNormMLP's is set_parallel_mode
    with pytest.raises(TypeError, match=r"splitgrad.LayerNormMLP .*\['checkpoint'\]"):
        make("mlp", checkpoint=True)
    with pytest.raises(TypeError, match="parameters_split"):
        make("mlp", parameters_split=None)  # not a te.LayerNormMLP keyword


def test_return_bias_as_te():
    model = make("mlp", return_bias=True, return_layernorm_output=True, delay_wgrad_compute=True)
    randomize(model)
    reference = to_reference(model)
    x = torch.randn(3, H)
    out, bias, ln_out = model(x)
    assert bias is model.fc2_bias
    ref_out, ref_bias, ref_ln = reference(x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    (out + bias).sum().backward()
    (ref_out + ref_bias).sum().backward()
    model.backward_dw()
    assert_same(model, reference)
    out, bias = make("linear", return_bias=True)(x)
    assert out.shape == (3, OUT) and bias.shape == (OUT,)


# 3. Delayed vs immediate, micro-batches, W order -----------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_delayed_equals_immediate_bit_for_bit(kind, dtype, device):
    """TE's test_numerics check: the same steps with delay_wgrad_compute on and off give identical
    gradients, over several micro-batches (the delayed work run after each backward, as TE's test).
    On CUDA both paths run the same cuBLASLt GEMMs."""
    kw = dict(activation="swiglu", device=device) if kind == "mlp" else dict(device=device)
    immediate = make(kind, params_dtype=dtype, **kw)
    randomize(immediate)
    delayed = make(kind, params_dtype=dtype, delay_wgrad_compute=True, **kw)
    delayed.load_state_dict(immediate.state_dict())
    for _ in range(3):
        x = torch.randn(4, 5, H).to(dtype=dtype, device=device)
        a, _ = exact_step(immediate, x, delay=False)
        b, _ = exact_step(delayed, x, delay=True)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(delayed, immediate)


SCHEDULES = ["F0 F1 B0 B1 W0 W1", "F0 B0 F1 W0 B1 W1", "F0 F1 B1 B0 W0 W1", "F0 F1 B0 B1 Wall"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_micro_batches_in_any_order(kind, schedule):
    model = make(kind, delay_wgrad_compute=True)
    randomize(model)
    reference = to_reference(model)
    xs = [torch.randn(3, H) for _ in range(2)]
    gys = [torch.randn(3, OUT if kind == "linear" else H) for _ in range(2)]
    per_pass = 1 if kind == "linear" else 2

    def w_step(token):
        if token == "Wall":
            splitgrad.backward_dw_all()
        else:
            before = model.pending_wgrads()
            model.backward_dw()
            assert model.pending_wgrads() == before - per_pass  # one pass: every GEMM of it

    run_schedule(schedule, model, xs, gys, w_step=w_step,
                 forward=lambda m, x, i: m(x, is_first_microbatch=(i == 0)))
    run_schedule(schedule, reference, xs, gys)
    assert splitgrad.pending_wgrads() == 0
    assert_same(model, reference)  # two terms per gradient: their order cannot matter


def test_backward_dw_runs_fc2_then_fc1_and_counts_the_module_items():
    model = make("mlp", delay_wgrad_compute=True)
    order = []
    for name in ("fc1_weight", "fc2_weight"):
        splitgrad.register_grad_ready_hook(getattr(model, name), lambda p, name=name: order.append(name))
    model(torch.randn(2, H)).sum().backward()
    model(torch.randn(2, H)).sum().backward()
    assert model.pending_wgrads() == 4 and splitgrad.pending_wgrads() == 4
    assert order == []
    model.backward_dw()
    assert order == ["fc2_weight", "fc1_weight"] and model.pending_wgrads() == 2
    model.backward_dw()
    assert model.pending_wgrads() == 0
    with pytest.raises(RuntimeError, match=r"LayerNormMLP\(8, 12\)#\d+.*no backward pass has queued"):
        model.backward_dw()


def test_regular_module_backward_dw_does_nothing():
    model = make("mlp")
    model(torch.randn(2, H)).sum().backward()
    assert splitgrad.pending_wgrads() == 0
    model.backward_dw()


# 4. Tying ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("delays", [(True, True), (True, False), (False, True)])
def test_two_layernorm_linears_sharing_weight_and_norm(delays):
    """QKV-style: two LayerNormLinears share their weight, a third shares the norm weight; a plain
    Linear shares the second's bias. Every contribution accumulates (TE keeps only the last)."""
    a = make("linear", delay_wgrad_compute=delays[0])
    b = make("linear", delay_wgrad_compute=delays[1])
    c = make("linear", normalization="RMSNorm", delay_wgrad_compute=True)
    d = splitgrad.Linear(H, OUT, device="cpu", delay_wgrad_compute=True)
    for m in (a, b, c, d):
        randomize(m, seed=len(list(m.parameters())))
    b.weight = a.weight
    c.layer_norm_weight = a.layer_norm_weight
    d.bias = b.bias
    model = nn.ModuleList([a, b, c, d])
    reference = to_reference(model)

    def forward(m, x, i):
        h = m[0](x) + m[1](x.flip(-1))
        return h + m[2](x * 2) + m[3](x)

    xs = [torch.randn(4, H) for _ in range(2)]
    gys = [torch.randn(4, OUT) for _ in range(2)]
    run_schedule("F0 F1 B0 B1 W0 W1", model, xs, gys, w_step=lambda t: backward_dw_each(model), forward=forward)
    run_schedule("F0 F1 B0 B1", reference, xs, gys, forward=forward)
    assert splitgrad.pending_wgrads() == 0
    got, want = named_gradients(model), named_gradients(reference)
    for name in got:
        # up to 4 terms: equal up to the order of the sums
        torch.testing.assert_close(got[name], want[name], rtol=1.3e-6, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_mlp_weight_tied_and_applied_twice():
    """Reuse: one LayerNormMLP applied twice in one forward, its fc2 weight also used by F.linear."""
    model = make("mlp", delay_wgrad_compute=True)
    randomize(model)
    reference = to_reference(model)

    def step(m, deferred):
        generator = torch.Generator().manual_seed(5)
        x, z = torch.randn(3, H, generator=generator), torch.randn(3, FFN, generator=generator)
        y = m(m(x)) + nn.functional.linear(z, m.fc2_weight)
        y.sum().backward()
        if deferred:
            assert m.pending_wgrads() == 4
            m.backward_dw()

    step(model, True)
    step(reference, False)
    assert splitgrad.pending_wgrads() == 0
    got, want = named_gradients(model), named_gradients(reference)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1.3e-6, atol=1e-5, msg=lambda m: f"{name}: {m}")


# 5. Fused main_grad ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
def test_fused_main_grad(delay, dtype):
    model = make("mlp", activation="geglu", params_dtype=dtype, delay_wgrad_compute=delay,
                 fuse_wgrad_accumulation=True)
    randomize(model)
    reference = to_reference(model, torch.float32)
    for name in ("fc1_weight", "fc2_weight", "fc2_bias"):  # fc1_bias has none: its gradient goes to .grad
        param = getattr(model, name)
        param.main_grad = torch.randn(param.shape)
        param.grad_added_to_main_grad = False
        getattr(reference, name).grad = param.main_grad.clone()
    x = torch.randn(2, 3, H)
    exact_step(model, x.to(dtype), delay=delay)
    exact_step(reference, x.to(dtype).float(), delay=False)
    for name in ("fc1_weight", "fc2_weight", "fc2_bias"):
        param = getattr(model, name)
        assert param.grad is None and param.grad_added_to_main_grad
        want = getattr(reference, name).grad
        if dtype == torch.float32:  # fp32 products added to an fp32 buffer, as autograd adds them
            torch.testing.assert_close(param.main_grad, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(param.main_grad, want, rtol=2e-2, atol=2e-2)
    # the norm's gradients and a bias without main_grad land in .grad, as in TE
    for name in ("layer_norm_weight", "layer_norm_bias", "fc1_bias"):
        assert getattr(model, name).grad is not None and getattr(model, name).grad.dtype == dtype


def test_fused_without_main_grad_names_module_and_parameter():
    model = make("mlp", fuse_wgrad_accumulation=True, name="blocks.0.mlp")
    with pytest.raises(splitgrad.MainGradError, match=r"'blocks.0.mlp'.*fc1_weight.main_grad"):
        model(torch.randn(2, H))
    model.fc1_weight.main_grad = torch.zeros(FFN, H)
    with pytest.raises(splitgrad.MainGradError, match=r"'blocks.0.mlp'.*fc2_weight.main_grad"):
        model(torch.randn(2, H))


# 6. Hooks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
def test_reduce_hooks_fire_once_per_pass_after_the_last_contribution(delay):
    a = make("mlp", delay_wgrad_compute=delay)
    b = make("mlp", delay_wgrad_compute=True)
    b.fc1_weight = a.fc1_weight  # tied: ready only after both contributions
    b.layer_norm_weight = a.layer_norm_weight
    calls = []
    finals = {}

    def hook(param):
        calls.append(param)
        finals[id(param)] = param.grad.clone()

    a.register_wgrad_accumulation_and_reduce_hooks(hook)
    b.register_wgrad_accumulation_and_reduce_hooks(hook)
    for _ in range(2):
        calls.clear()
        x = torch.randn(3, H)
        (a(x) + b(x)).sum().backward()
        # the norms' gradients are immediate: ready at the end of the backward
        assert any(p is a.layer_norm_bias for p in calls)
        assert not any(p is a.fc1_weight for p in calls)
        b.backward_dw()
        assert not any(p is a.fc1_weight for p in calls) or not delay
        a.backward_dw()
        params = {id(p): p for m in (a, b) for p in m.parameters()}
        counted = {k: sum(1 for c in calls if id(c) == k) for k in params}
        # once per parameter: the hook registered on both modules runs once for a shared one
        assert counted == {k: 1 for k in params}
        for k, p in params.items():
            torch.testing.assert_close(finals[k], p.grad, rtol=0, atol=0)  # nothing landed after it


# 7. Misuse ---------------------------------------------------------------------------------------

def test_wrong_input_names_the_module():
    model = make("mlp", name="mlp")
    with pytest.raises(splitgrad.ArgumentError, match=r"splitgrad layer 'mlp' \(fc1\): expected input of shape \[\*, 8\]"):
        model(torch.randn(2, H + 1))
    with pytest.raises(splitgrad.DTypeError, match=r"'mlp' \(fc1\): expected input of dtype torch.float32"):
        model(torch.randn(2, H, dtype=torch.float64))
    with pytest.raises(TypeError, match="'mlp': expected a torch.Tensor input"):
        model([1.0] * H)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        model(torch.randn(2, H), is_first_microbatch=1)
    ln = make("linear", name="qkv")
    with pytest.raises(ValueError, match=r"'qkv': expected input of shape \[\*, 8\]"):
        ln(torch.randn(2, 3))


def _bad_gemm_cases(gemm: str):
    """(parameter, replacement, error, message) for one of LayerNormMLP's GEMMs: its parameters
    replaced (as a tie by assignment would) with ones of the wrong shape, dtype or device."""
    out_features, in_features = (FFN, H) if gemm == "fc1" else (H, FFN)
    return [
        (f"{gemm}_weight", torch.randn(out_features, in_features + 1), splitgrad.ArgumentError,
         rf"expected input of shape \[\*, {in_features + 1}\]"),
        (f"{gemm}_weight", torch.randn(out_features, in_features, dtype=torch.float64), splitgrad.DTypeError,
         r"expected input of dtype torch.float64 \(the weight's dtype\)"),
        (f"{gemm}_weight", torch.empty(out_features, in_features, device="meta"), RuntimeError,
         r"expected input on meta"),
        (f"{gemm}_bias", torch.randn(out_features + 1), splitgrad.ArgumentError,
         rf"expected a bias of shape \[{out_features}\]"),
        (f"{gemm}_bias", torch.randn(out_features, dtype=torch.float64), splitgrad.DTypeError,
         r"expected a bias of dtype torch.float32"),
    ]


@pytest.mark.parametrize("path", ["op", "functional"])
@pytest.mark.parametrize("gemm", ["fc1", "fc2"])
def test_mlp_gemm_errors_name_the_module_and_the_gemm(gemm, path):
    """An error from one of LayerNormMLP's two GEMMs says which (fc1 / fc2), in the module's call
    and under torch.func (which runs the GEMMs without the op)."""
    from torch.func import functional_call, grad

    x = torch.randn(2, H)
    for name, value, error, message in _bad_gemm_cases(gemm):
        model = make("mlp", name="blocks.0.mlp")
        setattr(model, name, nn.Parameter(value))
        with pytest.raises(error, match=rf"splitgrad layer 'blocks.0.mlp' \({gemm}\): {message}"):
            if path == "op":
                model(x)
            else:
                grad(lambda p: functional_call(model, p, (x,)).sum())(dict(model.named_parameters()))
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("gemm", ["fc1", "fc2"])
def test_mlp_main_grad_errors_name_the_gemm_and_parameter(gemm, delay):
    x = torch.randn(2, H)
    for param, bad, message in [
        ("weight", lambda p: torch.zeros(3, 3), r"expected {0}.main_grad of shape \[{1}\]"),
        ("weight", lambda p: torch.zeros(p.shape, dtype=torch.float16), r"expected {0}.main_grad of dtype torch.float32"),
        ("bias", lambda p: torch.zeros(p.shape[0] + 1), r"expected {0}.main_grad of shape \[{1}\]"),
        ("weight", lambda p: None, r"fuse_wgrad_accumulation=True needs {0}.main_grad, an fp32 tensor of shape "
                                   r"\[{1}\] \(Megatron's contract\); it is not set"),
        ("weight", lambda p: [0.0], r"expected {0}.main_grad to be a torch.Tensor, got list"),
    ]:
        model = make("mlp", name="blocks.0.mlp", fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
        for name in ("fc1_weight", "fc2_weight"):
            getattr(model, name).main_grad = torch.zeros(getattr(model, name).shape)
        target = getattr(model, f"{gemm}_{param}")
        if bad(target) is None:
            del target.main_grad
        else:
            target.main_grad = bad(target)
        shape = ", ".join(map(str, target.shape))
        with pytest.raises(splitgrad.MainGradError,
                           match=rf"splitgrad layer 'blocks.0.mlp' \({gemm}\): " + message.format(f"{gemm}_{param}", shape)):
            model(x)
    assert splitgrad.pending_wgrads() == 0


def test_bad_constructor_arguments():
    with pytest.raises(splitgrad.ArgumentError, match="normalization 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"):
        make("linear", normalization="BatchNorm")
    with pytest.raises(splitgrad.ArgumentError, match=r"activation in .*got 'tanh'"):
        make("mlp", activation="tanh")
    with pytest.raises(splitgrad.ArgumentError, match="positive int ffn_hidden_size, got 0"):
        splitgrad.LayerNormMLP(8, 0, device="cpu")
    with pytest.raises(splitgrad.DTypeError, match="LayerNormLinear: expected a floating-point params_dtype"):
        make("linear", params_dtype=torch.int64)


def test_stashed_norm_output_modified_in_place_is_an_error_and_loses_nothing_else():
    model = make("linear", return_layernorm_output=True, delay_wgrad_compute=True, name="qkv")
    out, ln_out = model(torch.randn(3, H))
    out.sum().backward()
    ln_out.add_(1.0)  # fc's stashed input
    with pytest.raises(RuntimeError, match="'qkv': the input stashed for its deferred weight gradient was modified"):
        model.backward_dw()
    assert model.weight.grad is None and splitgrad.pending_wgrads() == 0


FC_PARAMS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


def _fails_then_next_pass_is_exact(model, spoil, message):
    """One backward pass of a delayed LayerNormMLP queues fc2's and fc1's items; ``spoil(out)``
    modifies one's stash in place. backward_dw() raises ``message``, writes no fc gradient, and takes
    both items off the queue, reported dropped (the pass's grad-ready hooks do not fire). The next
    pass then needs one backward_dw(), and its gradients are plain autograd's, bit for bit."""
    randomize(model)
    fired = []
    for name in FC_PARAMS:
        splitgrad.register_grad_ready_hook(getattr(model, name), lambda p, name=name: fired.append(name))
    out = model(torch.randn(3, H))
    loss_of(out).backward()
    assert model.pending_wgrads() == 2
    spoil(out)
    with pytest.raises(RuntimeError, match=message):
        model.backward_dw()
    assert model.pending_wgrads() == 0 and splitgrad.pending_wgrads() == 0
    for name in FC_PARAMS:
        param = getattr(model, name)
        assert param.grad is None, name
        assert splitgrad._C.pending_wgrads_for(param) == 0 and splitgrad._C.dropped_wgrads_for(param) == 1, name
    assert fired == []  # that pass's fc gradients are incomplete: their reducers must not run
    with pytest.raises(RuntimeError, match="no backward pass has queued"):
        model.backward_dw()  # nothing of the failed pass is left to run
    model.zero_grad(set_to_none=True)
    reference = to_reference(model)
    x = torch.randn(3, H)
    loss_of(model(x)).backward()
    loss_of(reference(x)).backward()
    model.backward_dw()
    assert splitgrad.pending_wgrads() == 0
    assert_same(model, reference)
    assert sorted(fired) == sorted(FC_PARAMS)


def test_mlp_norm_output_modified_in_place_names_fc1_and_drops_the_pass():
    """fc1's stash is the norm's output (returned by return_layernorm_output): modified in place,
    the error names the module, fc1, its input and its weight's shape, and says that fc2's item of
    that pass was dropped too."""
    model = make("mlp", return_layernorm_output=True, delay_wgrad_compute=True, name="blocks.0.mlp")
    fc1_shape = re.escape(str(list(model.fc1_weight.shape)))
    _fails_then_next_pass_is_exact(
        model, lambda out: out[1].add_(1.0),
        rf"^splitgrad layer 'blocks.0.mlp' \(fc1\): the input stashed for its deferred weight gradient was "
        rf"modified in place .* That item, for the weight of shape {fc1_shape}, was dropped .* The other 1 "
        r"deferred item\(s\) that backward pass queued for this layer \(fc2\) were dropped too")


def test_mlp_fc1_output_modified_in_place_names_fc2s_stash_and_drops_the_pass():
    """fc2's deferred item keeps fc1's output (the activation's input): modified in place, the error
    names fc2 and that stash, and says that fc1's item of that pass was dropped too."""
    model = make("mlp", delay_wgrad_compute=True, name="blocks.0.mlp")
    kept = []

    def spoil(out):
        fc1_out = [t for t in kept if t.shape[-1] == model.fc1_weight.shape[0]]
        assert fc1_out, "fc1's output is among the saved tensors"
        fc1_out[0].add_(1.0)

    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
        _fails_then_next_pass_is_exact(
            model, spoil,
            r"^splitgrad layer 'blocks.0.mlp' \(fc2\): the input of its activation \"\w+\" \(in a LayerNormMLP: "
            r"fc2's, fc1's output\) stashed .* The other 1 deferred item\(s\) that backward pass queued for this "
            r"layer \(fc1\) were dropped too")


def test_pending_work_guards_name_the_module():
    model = make("mlp", delay_wgrad_compute=True, name="blocks.1.mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, H)).sum().backward()
    with pytest.warns(splitgrad.PendingWgradWarning, match="'blocks.1.mlp'"):
        optimizer.step()
    with pytest.warns(splitgrad.PendingWgradWarning, match="state_dict.*'blocks.1.mlp'"):
        model.state_dict()
    splitgrad.set_pending_work_policy("error")
    with pytest.raises(splitgrad.PendingWgradError, match="'blocks.1.mlp'"):
        model.zero_grad()
    model.backward_dw()
    optimizer.step()


def test_deleted_with_work_pending_warns_with_its_name():
    model = make("mlp", delay_wgrad_compute=True, name="doomed")
    model(torch.randn(2, H)).sum().backward()
    with pytest.warns(splitgrad.PendingWgradWarning, match="'doomed' was deleted with 2 deferred"):
        del model
        import gc
        gc.collect()
    assert splitgrad.pending_wgrads() == 0


# 8. Names, copies, export, compile, torch.func -----------------------------------------------

def test_names_and_copies():
    model = nn.Sequential(make("linear"), make("mlp"))
    assert model[0].name.startswith("LayerNormLinear(8, 6)#") and model[1].name.startswith("LayerNormMLP(8, 12)#")
    clone = copy.deepcopy(model[1])
    assert clone.name != model[1].name and clone.name.startswith("LayerNormMLP(8, 12)#")
    splitgrad.name_layers(model)
    assert [m.name for m in model] == ["0", "1"]


def test_torch_export_records_regular_calls_and_matches():
    model = make("mlp", activation="swiglu", delay_wgrad_compute=True)
    x = torch.randn(3, H)
    program = torch.export.export(model, (x,))
    calls = [n for n in program.graph.nodes if n.target is torch.ops.splitgrad.linear.default]
    assert len(calls) == 2 and all(n.args[5] == 0 and n.args[6] is False for n in calls)  # regular, no layer
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
def test_torch_compile_matches_eager(delay):
    model = make("mlp", delay_wgrad_compute=delay)
    randomize(model)
    reference = to_reference(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, H)
    loss_of(compiled(x)).backward()
    model.backward_dw()
    loss_of(reference(x)).backward()
    assert splitgrad.pending_wgrads() == 0
    got, want = named_gradients(model), named_gradients(reference)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1.3e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_torch_compile_fullgraph_of_a_16_bit_zero_centred_norm(kind):
    """A regular module (neither delayed nor fused) compiles to one graph, 16-bit zero-centred
    gamma included (its norm asked whether autocast was available, which Dynamo cannot trace:
    fullgraph=True failed, a graph break without it; helper-44)."""
    model = make(kind, zero_centered_gamma=True, params_dtype=torch.bfloat16)
    randomize(model)
    reference = to_reference(model)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    torch._dynamo.reset()
    loss_of(torch.compile(model, backend="aot_eager", fullgraph=True)(x)).backward()
    loss_of(reference(x)).backward()
    got, want = named_gradients(model), named_gradients(reference)
    for name in got:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("how", ["inference", "expanded"])
@pytest.mark.parametrize("bad", ["fc1_weight", "fc1_bias", "fc2_weight"])
def test_an_unwritable_grad_leaves_the_whole_pass_unwritten(bad, how):
    """A LayerNormMLP's .grads are kept between micro-batches and one cannot take an in-place add:
    backward_dw() raises naming the layer and its GEMM before any of the pass's items runs (fc2's
    item ran first and wrote its gradients when fc1's .grad was the bad one; helper-44). Both
    items are dropped and reported, every .grad as it was."""
    model = make("mlp", delay_wgrad_compute=True, name="mlp")
    params = dict(model.named_parameters())
    for name, p in params.items():
        p.grad = torch.randn_like(p)
    params[bad].grad = unwritable_grad(params[bad], how)
    before = {name: p.grad.clone() for name, p in params.items()}
    model(torch.randn(3, H)).sum().backward()
    before.update({n: params[n].grad.clone() for n in ("layer_norm_weight", "layer_norm_bias")})  # immediate
    gemm, what = bad.split("_")
    match = "inference tensor" if how == "inference" else "share memory"
    with pytest.raises(RuntimeError, match=rf"'mlp' \({gemm}\): .*\.grad of {what}: .*{match}.*all or none"):
        model.backward_dw()
    assert model.pending_wgrads() == 0
    for name, p in params.items():
        if not name.startswith("layer_norm"):
            assert splitgrad._C.dropped_wgrads_for(p) == 1, name
        torch.testing.assert_close(p.grad, before[name], rtol=0, atol=0, msg=name)


def test_torch_func_grad_matches_and_queues_nothing():
    from torch.func import functional_call, grad

    model = make("mlp", activation="reglu", delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    randomize(model)
    reference = to_reference(model)
    params = dict(model.named_parameters())
    x = torch.randn(3, H)
    got = grad(lambda p: functional_call(model, p, (x,)).sum())(params)
    want = grad(lambda p: functional_call(reference, p, (x,)).sum())(dict(reference.named_parameters()))
    assert splitgrad.pending_wgrads() == 0
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"LayerNormMLP\(8, 12\)#\d+' \(fc1\): expected input of shape"):
        grad(lambda x: model(x).sum())(torch.randn(2, H + 1))


def test_import_splitgrad_as_te():
    import splitgrad as te

    qkv = te.LayerNormLinear(16, 48, eps=1e-5, bias=True, normalization="RMSNorm", params_dtype=torch.bfloat16,
                             device="cpu", delay_wgrad_compute=True, sequence_parallel=False, tp_size=1)
    mlp = te.LayerNormMLP(16, 64, activation="swiglu", normalization="RMSNorm", params_dtype=torch.bfloat16,
                          device="cpu", delay_wgrad_compute=True, seq_length=None, micro_batch_size=None)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    (mlp(x).float().sum() + qkv(x).float().sum()).backward()
    mlp.backward_dw()
    qkv.backward_dw()
    assert all(p.grad is not None for m in (qkv, mlp) for p in m.parameters())
    assert splitgrad.pending_wgrads() == 0


# 9. What the backward keeps ----------------------------------------------------------------------

def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward in a forward of ``model``,
    parameters excluded (they exist anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    loss_of(out).backward()
    return sum(storages.values())


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_backward_keeps_no_more_than_plain_pytorch(activation, normalization):
    """The norm's output is saved once (fc1's input), fc1's output once (the activation's input):
    the same storages plain PyTorch saves for the same block."""
    model = make("mlp", activation=activation, normalization=normalization, delay_wgrad_compute=True)
    reference = to_reference(model)
    x = torch.randn(16, H, requires_grad=True)
    got = saved_activation_bytes(model, x)
    model.backward_dw()
    want = saved_activation_bytes(reference, x)
    assert 0 < got <= want, (got, want)


def test_jit_trace_records_regular_calls_and_script_is_refused():
    model = make("linear", delay_wgrad_compute=True, name="qkv")
    x = torch.randn(3, H)
    traced = torch.jit.trace(model, (x,), check_trace=False)
    traced(x).sum().backward()
    assert splitgrad.pending_wgrads() == 0 and model.weight.grad is not None  # regular, unregistered
    with pytest.raises(TypeError, match="'qkv' cannot be compiled by torch.jit.script"):
        torch.jit.script(model)


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_autocast_matches_plain_pytorch(kind, normalization):
    """Under CPU autocast (bf16) the norm runs as autocast runs F.layer_norm / F.rms_norm and the
    GEMMs in bf16, as nn.Linear's: outputs and gradients bit for bit."""
    model = make(kind, normalization=normalization, delay_wgrad_compute=True)
    randomize(model)
    reference = to_reference(model)
    x = torch.randn(4, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref_out = model(x), reference(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    loss_of(out).backward()
    loss_of(ref_out).backward()
    model.backward_dw()
    assert_same(model, reference)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_autocast_with_16_bit_zero_centred_gamma_matches_plain_pytorch(kind, params_dtype, autocast_dtype):
    """16-bit parameters with zero-centred gamma under CPU autocast: the norm runs in fp32 (1 + gamma
    added in fp32, as TE's kernels add it) and its output is rounded once, as outside autocast; CPU
    autocast does not run layer_norm in fp32, and its mixed-dtype kernel gave other gamma and beta
    gradients (helper-44). Outputs and gradients bit for bit."""
    model = make(kind, zero_centered_gamma=True, params_dtype=params_dtype, delay_wgrad_compute=True,
                 return_layernorm_output=True)
    randomize(model)
    reference = to_reference(model)
    x = torch.randn(16, H, dtype=params_dtype) * 3
    with torch.autocast("cpu", dtype=autocast_dtype):
        out, ref_out = model(x), reference(x)
    for got, want in zip(out, ref_out):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    loss_of(out).backward()
    loss_of(ref_out).backward()
    model.backward_dw()
    assert_same(model, reference)


# 10. Reducers and FSDP2 (one gloo rank: the hooks, launches and deferred reductions) -------------

@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available in this PyTorch build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def block():
    return nn.Sequential(
        splitgrad.LayerNormLinear(H, H, normalization="RMSNorm", device="cpu", delay_wgrad_compute=True),
        make("mlp", activation="swiglu", delay_wgrad_compute=True))


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_grad_reducer_reduces_after_the_last_deferred_contribution(one_rank, mode):
    model = block()
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, mode=mode, bucket_cap_mb=1e-6)  # a bucket each
    for _ in range(2):
        x = torch.randn(3, H)
        loss_of(model(x)).backward()
        launched = len(reducer.launch_log)
        model[1].backward_dw()
        assert len(reducer.launch_log) > launched  # fc2's and fc1's buckets start in backward_dw()
        model[0].backward_dw()
        reducer.finish()
        loss_of(reference(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        if mode == "reduce_scatter":  # one rank: its shard is the whole gradient
            torch.testing.assert_close(reducer.sharded_grad(p), q.grad.flatten(), rtol=0, atol=0)


def test_fully_shard_reduces_in_backward_dw(one_rank):
    import splitgrad.distributed as sgd

    model = nn.Sequential(block(), block())
    reference = to_reference(model)
    for unit in model:
        sgd.fully_shard(unit)
    sgd.fully_shard(model)
    sgd.fsdp_reduction_log.clear()
    x = torch.randn(3, H)
    loss_of(model(x)).backward()
    for unit in reversed(model):
        unit[1].backward_dw()
        unit[0].backward_dw()
    sgd.finish_fsdp_reductions()
    assert [when for _, when in sgd.fsdp_reduction_log].count("backward_dw") == 2  # each block's unit
    loss_of(reference(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_zero_bubble_pipeline_stage_runs_their_w_steps(one_rank):
    """ZB-V on one rank (both stages of the V here): the split backward's W steps run the modules'
    deferred work, and the gradients equal plain autograd's over the same micro-batches."""
    import splitgrad.pipelining as sgp
    from torch.distributed import pipelining

    micro = 4
    pieces = [block(), block()]
    reference = to_reference(nn.Sequential(*copy.deepcopy(pieces)))
    stages = [sgp.PipelineStage(pieces[s], s, 2, "cpu") for s in range(2)]
    assert [len(stage.delayed_layers) for stage in stages] == [2, 2]

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    schedule = pipelining.ScheduleZBVZeroBubble(stages, n_microbatches=micro, loss_fn=loss_fn)
    x, target = torch.randn(2 * micro, H), torch.randn(2 * micro, H)
    schedule.step(x, target=target)
    assert splitgrad.pending_wgrads() == 0
    for xs, ts in zip(x.chunk(micro), target.chunk(micro)):
        (loss_fn(reference(xs), ts) / micro).backward()
    for (name, p), q in zip(nn.Sequential(*pieces).named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# 11. CUDA: the cuBLASLt back end against plain PyTorch ------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind,activation,normalization",
                         [("linear", None, "LayerNorm"), ("linear", None, "RMSNorm"), ("mlp", "gelu", "LayerNorm"),
                          ("mlp", "swiglu", "RMSNorm"), ("mlp", "reglu", "LayerNorm")])
def test_cuda_matches_plain_pytorch(kind, activation, normalization, dtype, fused):
    """Delayed modules on CUDA over two micro-batches against plain PyTorch: float32 to its
    tolerance, 16-bit within 2x PyTorch's own error against a float64 reference."""
    kw = dict(activation=activation) if activation else {}
    model = make(kind, device="cuda", normalization=normalization, params_dtype=dtype, delay_wgrad_compute=True,
                 fuse_wgrad_accumulation=fused, **kw)
    randomize(model)
    if fused:
        for name in ("weight", "fc1_weight", "fc2_weight"):
            if hasattr(model, name):
                getattr(model, name).main_grad = torch.zeros_like(getattr(model, name), dtype=torch.float32)
    reference = to_reference(model)
    high = to_reference(model, torch.float64)
    xs = [torch.randn(4, 5, H, device="cuda") for _ in range(2)]  # float32 values: exact in float64 too
    for m in (model, reference, high):
        for x in xs:
            loss_of(m(x.to(m.layer_norm_weight.dtype))).backward()
    model.backward_dw()
    model.backward_dw()
    assert splitgrad.pending_wgrads() == 0
    if fused:
        assert (model.fc1_weight if kind == "mlp" else model.weight).grad is None
    assert_grads_match(model, reference, exact=False, high_precision=high)


@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
def test_modules_on_the_meta_device_give_shapes(module):
    """As splitgrad.Linear and nn.Linear: a model built on the meta device (deferred init, shape
    inference) runs its forward; a device without autocast is no error."""
    make = getattr(splitgrad, module)
    layer = make(16, 24, device="meta", delay_wgrad_compute=True)
    out = layer(torch.empty(5, 16, device="meta"))
    assert out.device.type == "meta" and out.shape == (5, 16 if module == "LayerNormMLP" else 24)
