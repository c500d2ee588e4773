"""GroupedLinear on the grouped GEMM kernels (Hopper, bf16, feature counts that are multiples of 8):
one launch per product, the splits read on the device only.

Compared against per-expert plain autograd (sg_helpers.RefGroupedLinear: F.linear per expert, as
nn.Linear runs it) and a float64 twin: splitgrad's error against float64 stays within 2x PyTorch's
own bf16 error. Delayed and immediate wgrad run the same kernels, so they agree bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import splitgrad
from sg_helpers import NO_CUDA, assert_grads_match, assert_within_torch_error, to_reference

ops = torch.ops.splitgrad

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason=NO_CUDA + " (the grouped GEMM kernels need an SM 9.0 GPU)")

IN, OUT = 64, 128
SPLITS = {
    "imbalanced-with-zeros": [300, 0, 17, 1, 0, 190, 5, 0],
    "one-takes-all": [0, 0, 0, 513, 0, 0, 0, 0],
    "no-rows": [0] * 8,
    "odd": [3, 7, 1, 9, 2, 8, 5, 11],
    # 1024+ rows per expert on average: with host splits fprop and dgrad loop over the experts
    "few-large": [1024, 2048, 16, 1200, 1100, 1500, 1024, 1312],
}

# The fp32 wgrad has two kernels, picked by the experts' average rows and the device's bandwidth
# (src/cuda/grouped_gemm.cpp): each is forced in the main_grad tests, so both stay tested on any
# Hopper.
WGRAD_SCHEDULES = ["shipped-choice", "pingpong", "cooperative"]


def _layer(n=8, dtype=torch.bfloat16, in_features=IN, out_features=OUT, **kw):
    torch.manual_seed(0)
    return splitgrad.GroupedLinear(n, in_features, out_features, params_dtype=dtype, device="cuda", **kw)


def _data(splits, in_features=IN, out_features=OUT, dtype=torch.bfloat16):
    rows = sum(splits)
    x = torch.randn(rows, in_features, device="cuda").to(dtype)
    gy = torch.randn(rows, out_features, device="cuda").to(dtype)
    return x, gy


def _run(layer, x, gy, m_splits):
    xr = x.detach().clone().requires_grad_()
    y = layer(xr, m_splits)
    y.backward(gy)
    layer.backward_dw()
    return y, xr.grad


@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("splits_on", ["cuda", "cpu", "list"])
def test_matches_per_expert_autograd(splits, bias, delay, splits_on):
    layer = _layer(bias=bias, delay_wgrad_compute=delay)
    reference, high = to_reference(layer), to_reference(layer, torch.float64)
    x, gy = _data(splits)
    m_splits = splits if splits_on == "list" else torch.tensor(splits, device=splits_on)
    y, dx = _run(layer, x, gy, m_splits)
    xr = x.detach().clone().requires_grad_()
    y_ref = reference(xr, splits)
    y_ref.backward(gy)
    xh = x.double().requires_grad_()
    y_high = high(xh, splits)
    y_high.backward(gy.double())
    assert_within_torch_error("y", y, y_ref, y_high, torch.bfloat16)
    assert_within_torch_error("dx", dx, xr.grad, xh.grad, torch.bfloat16)
    assert_grads_match(layer, reference, exact=False, high_precision=high)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_delayed_equals_immediate_bit_for_bit(bias):
    splits = SPLITS["imbalanced-with-zeros"]
    x, gy = _data(splits)
    grads = []
    for delay in (False, True):
        layer = _layer(bias=bias, delay_wgrad_compute=delay)
        _run(layer, x, gy, torch.tensor(splits, device="cuda"))
        grads.append([p.grad for p in layer.parameters()])
    for immediate, delayed in zip(*grads):
        torch.testing.assert_close(delayed, immediate, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", WGRAD_SCHEDULES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
def test_fused_main_grad_fp32(bias, splits, schedule, monkeypatch):
    """bf16 experts, fp32 main_grad with an earlier value: each expert's sum is added in fp32 in the
    GEMM's epilogue; closer to float64 than PyTorch's bf16 gradient added to it. Each fp32 wgrad
    kernel forced in turn (SPLITGRAD_GROUPED_WGRAD_SCHEDULE), besides the one the layer picks."""
    if schedule != "shipped-choice":
        monkeypatch.setenv("SPLITGRAD_GROUPED_WGRAD_SCHEDULE", schedule)
    layer = _layer(bias=bias, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    for p in layer.parameters():
        p.main_grad = torch.randn(p.shape, device="cuda")
        p.grad_added_to_main_grad = False
    start = {name: p.main_grad.clone() for name, p in layer.named_parameters()}
    reference, high = to_reference(layer), to_reference(layer, torch.float64)
    x, gy = _data(splits)
    _run(layer, x, gy, torch.tensor(splits, device="cuda"))
    reference(x, splits).backward(gy)
    high(x.double(), splits).backward(gy.double())
    for (name, p), p_ref, p_high in zip(layer.named_parameters(), reference.parameters(), high.parameters()):
        assert p.grad is None and p.grad_added_to_main_grad
        err = (p.main_grad.double() - p_high.grad).abs().max().item()
        err_torch = (p_ref.grad.double() - p_high.grad).abs().max().item()
        assert err <= err_torch + 1e-5, f"{name}: {err:.3g} vs PyTorch's {err_torch:.3g}"
        if sum(splits) == 0:
            torch.testing.assert_close(p.main_grad, start[name], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", WGRAD_SCHEDULES)
@pytest.mark.parametrize("features", [(256, 512), (512, 256)], ids=["out>in", "in>out"])
def test_fused_main_grad_matches_fp32_per_expert_sums(schedule, features, monkeypatch):
    """The fp32 accumulation itself: main_grad += dyᵀ·x in fp32 equals the per-expert fp32 product
    of the same bf16 values to fp32 rounding, with either kernel and tile order (along M where
    in > out, along N otherwise)."""
    if schedule != "shipped-choice":
        monkeypatch.setenv("SPLITGRAD_GROUPED_WGRAD_SCHEDULE", schedule)
    in_features, out_features = features
    layer = _layer(bias=True, delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                   in_features=in_features, out_features=out_features)
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, device="cuda")
    splits = [700, 0, 31, 1, 129, 0, 64, 99]
    x, gy = _data(splits, in_features, out_features)
    _run(layer, x, gy, torch.tensor(splits, device="cuda"))
    offset = 0
    for i, rows in enumerate(splits):
        dy_i, x_i = gy[offset:offset + rows].double(), x[offset:offset + rows].double()
        offset += rows
        torch.testing.assert_close(layer.weights[i].main_grad.double(), dy_i.t() @ x_i, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(layer.biases[i].main_grad.double(), dy_i.sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_tied_experts_add_up(fused):
    """weight1 is weight5 (and bias1 is bias5): one target appears twice in a launch's groups, so
    the launches are split and the tied target sums both experts."""
    layer = _layer(delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    layer.weight5 = layer.weight1
    layer.bias5 = layer.bias1
    if fused:
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda")
    reference, high = to_reference(layer), to_reference(layer, torch.float64)
    splits = SPLITS["imbalanced-with-zeros"]
    x, gy = _data(splits)
    _run(layer, x, gy, torch.tensor(splits, device="cuda"))
    reference(x, splits).backward(gy)
    high(x.double(), splits).backward(gy.double())
    assert_grads_match(layer, reference, exact=False, high_precision=high)


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_fresh_gradients_are_independent_and_take_a_second_pass(delay):
    """The experts' fresh .grads come from one buffer: each is a tensor of its own (an in-place
    change to one leaves the others as they were), and a second pass adds into all of them (one
    multi-tensor add) as plain autograd adds into its .grads."""
    layer = _layer(bias=True, delay_wgrad_compute=delay)
    reference, high = to_reference(layer), to_reference(layer, torch.float64)
    splits = SPLITS["imbalanced-with-zeros"]
    x, gy = _data(splits)
    _run(layer, x, gy, torch.tensor(splits, device="cuda"))
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None and g.is_contiguous() and g._base is None for g in grads)
    before = [g.clone() for g in grads]
    grads[0].add_(1.0)
    grads[len(grads) - 1].zero_()
    for i, (g, b) in enumerate(zip(grads, before)):
        if i not in (0, len(grads) - 1):
            torch.testing.assert_close(g, b, rtol=0, atol=0)
    grads[0].copy_(before[0])
    grads[len(grads) - 1].copy_(before[-1])
    _run(layer, x, gy, torch.tensor(splits, device="cuda"))
    for _ in range(2):
        reference(x, splits).backward(gy)
        high(x.double(), splits).backward(gy.double())
    assert_grads_match(layer, reference, exact=False, high_precision=high)


@pytest.mark.parametrize("splits_on", ["cuda", "list"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fresh_gradients_are_written_whole_into_reused_memory(splits_on, bias):
    """Fresh .grads are written by the grouped kernels into memory that is not filled first: an
    expert without rows gets exact zeros (weight and bias), the others their sums, whatever the
    caching allocator hands out (here: blocks that held nans)."""
    layer = _layer(bias=bias, delay_wgrad_compute=True)
    reference, high = to_reference(layer), to_reference(layer, torch.float64)
    splits = SPLITS["imbalanced-with-zeros"]
    x, gy = _data(splits)
    m_splits = splits if splits_on == "list" else torch.tensor(splits, device="cuda")
    garbage = [torch.full((1 << 18,), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(64)]
    del garbage  # cached by the allocator: the next small allocations reuse these blocks
    _run(layer, x, gy, m_splits)
    reference(x, splits).backward(gy)
    high(x.double(), splits).backward(gy.double())
    for i, rows in enumerate(splits):
        names = [f"weight{i}"] + ([f"bias{i}"] if bias else [])
        for name in names:
            grad = getattr(layer, name).grad
            assert not grad.isnan().any(), f"{name}: nan in a fresh gradient"
            if rows == 0:
                assert torch.equal(grad, torch.zeros_like(grad)), f"{name}: an expert without rows"
    assert_grads_match(layer, reference, exact=False, high_precision=high)


def test_no_host_synchronisation_with_device_splits():
    """A router's counts on the device: forward, backward and backward_dw (bias, fused fp32
    main_grad) never wait for the device."""
    layer = _layer(bias=True, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, device="cuda")
    splits = torch.tensor(SPLITS["imbalanced-with-zeros"], device="cuda")
    x, gy = _data(SPLITS["imbalanced-with-zeros"])
    x.requires_grad_()
    _run(layer, x, gy, splits)  # warm-up: first-call allocations and kernel loading
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, splits)
        y.backward(gy)
        layer.backward_dw()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_deterministic():
    splits = SPLITS["imbalanced-with-zeros"]
    x, gy = _data(splits)
    results = []
    for _ in range(2):
        layer = _layer(bias=True, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda")
        y, dx = _run(layer, x, gy, torch.tensor(splits, device="cuda"))
        results.append([y, dx] + [p.main_grad for p in layer.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["strided-input", "misaligned-input", "odd-features"])
def test_operands_the_kernels_do_not_take_fall_back(layout):
    """A strided or misaligned input, or features that are not a multiple of 8, go through the
    per-expert loop: the same gradients as per-expert autograd."""
    in_features, out_features = (IN, OUT) if layout != "odd-features" else (60, 124)
    layer = _layer(bias=True, delay_wgrad_compute=True, in_features=in_features, out_features=out_features)
    reference, high = to_reference(layer), to_reference(layer, torch.float64)
    splits = SPLITS["imbalanced-with-zeros"]
    x, gy = _data(splits, in_features, out_features)
    if layout == "strided-input":
        x = torch.cat([x, x], dim=1)[:, ::2]
    elif layout == "misaligned-input":
        x = torch.cat([torch.zeros(1, device="cuda", dtype=x.dtype), x.flatten()])[1:].view_as(x)
        assert x.data_ptr() % 16 != 0
    _run(layer, x, gy, torch.tensor(splits, device="cuda"))
    reference(x, splits).backward(gy)
    high(x.double(), splits).backward(gy.double())
    assert_grads_match(layer, reference, exact=False, high_precision=high)


def test_ops_wgrad_accumulate_into_bf16_targets():
    """The bf16-target kernel: grads += dyᵀ·x (fp32 sum, added in fp32, rounded once)."""
    splits = [100, 0, 28, 3, 0, 1, 64, 60]
    x, gy = _data(splits)
    targets = [torch.randn(OUT, IN, device="cuda").to(torch.bfloat16) for _ in splits]
    start = [t.clone() for t in targets]
    ops.grouped_linear_wgrad_accumulate_(gy, x, torch.tensor(splits, device="cuda"), targets, [])
    offset = 0
    for t, s, rows in zip(targets, start, splits):
        want = s.double() + gy[offset:offset + rows].double().t() @ x[offset:offset + rows].double()
        offset += rows
        torch.testing.assert_close(t.double(), want, rtol=0.01, atol=0.05)
        if rows == 0:
            torch.testing.assert_close(t, s, rtol=0, atol=0)


BAD_SPLIT_CALLS = {
    "forward": "splitgrad.GroupedLinear(3, 64, 64, params_dtype=torch.bfloat16, device='cuda')(x, splits)",
    "forward-no-bias": "splitgrad.GroupedLinear(3, 64, 64, bias=False, params_dtype=torch.bfloat16, device='cuda')(x, splits)",
    "bias-grads-only": "torch.ops.splitgrad.grouped_linear_wgrad_accumulate_(x, x, splits, [], [torch.zeros(64, device='cuda')] * 3)",
}


BAD_DEVICE_SPLITS = {
    "negative": ("[5, -2, 13]", "m_splits[1] = -2 is negative"),
    "short-sum": ("[5, 2, 3]", "m_splits sum to 10, expected the input's 16 rows"),
    # Sums to 2**64 + 16, which wraps to the 16 rows in int64 arithmetic: the check must not wrap.
    "overflow": ("[2**62, 2**63 - 1, 2**62 + 17]", "m_splits[1] = 9223372036854775807 takes the sum past"),
}


@pytest.mark.parametrize("call", list(BAD_SPLIT_CALLS))
@pytest.mark.parametrize("bad", list(BAD_DEVICE_SPLITS))
def test_bad_device_splits_stop_the_kernel(bad, call):
    """Device splits cannot be checked on the host without a synchronisation: the kernels check
    them (a grouped GEMM's argument kernel, or a check of their own where no GEMM runs) and stop
    with a device-side assertion that names the problem (in a child process: the assertion ends
    the CUDA context)."""
    splits, expected = BAD_DEVICE_SPLITS[bad]
    script = textwrap.dedent(f"""
        import torch, splitgrad
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
        splits = torch.tensor({splits}, device="cuda")
        {BAD_SPLIT_CALLS[call]}
        torch.cuda.synchronize()
        print("NO ERROR")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "NO ERROR" not in output, output
    assert expected in output, output


@pytest.mark.parametrize("splits_as", ["cuda", "list"])
@pytest.mark.parametrize("fused", [True, False], ids=["main_grad", "grad"])
def test_captured_step_replays_bit_identical_to_eager_steps(fused, splits_as):
    """A training step of a GroupedLinear (forward, backward, backward_dw; a tied expert) captured
    once in a CUDA graph replays what the eager steps give, bit for bit: the experts' pointer
    tables and host splits' values are kernel parameters, captured by value."""
    splits = SPLITS["imbalanced-with-zeros"]
    splits = torch.tensor(splits, device="cuda") if splits_as == "cuda" else splits
    generator = torch.Generator(device="cuda").manual_seed(5)
    inputs = [torch.randn(sum(SPLITS["imbalanced-with-zeros"]), IN, device="cuda", dtype=torch.bfloat16,
                          generator=generator) for _ in range(3)]

    def make():
        layer = _layer(bias=True, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
        layer.weight5 = layer.weight1
        if fused:
            for p in layer.parameters():
                p.main_grad = torch.zeros(p.shape, device="cuda")
        return layer

    def step(layer, x):
        layer(x, splits).float().square().mean().backward()
        layer.backward_dw()

    def gradients(layer):
        return [(p.main_grad if fused else p.grad).clone() for p in layer.parameters()]

    eager, graphed = make(), make()
    expected = []
    for x in inputs:
        for p in eager.parameters():
            p.grad = None
        step(eager, x)
        expected.append(gradients(eager))
    static_x = torch.zeros_like(inputs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(graphed, static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p in graphed.parameters():
        p.grad = None
        if fused:
            p.main_grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, static_x)
    for x, want in zip(inputs, expected):
        static_x.copy_(x)
        graph.replay()
        for got, exp in zip(gradients(graphed), want):
            assert torch.equal(got, exp)
    assert len({float(g.abs().sum()) for g in expected[-1]}) > 1


def test_host_splits_changed_after_the_call_do_not_reach_the_kernel():
    """Pinned host splits are taken by value at the call: refilling the buffer at once (as a router
    does for the next micro-batch) changes nothing already launched."""
    splits = SPLITS["imbalanced-with-zeros"]
    pinned = torch.tensor(splits).pin_memory()
    layer = _layer(bias=True)
    x, _ = _data(splits)
    torch.cuda._sleep(50_000_000)  # the launches below wait behind this on the stream
    y = layer(x, pinned)
    pinned.copy_(torch.tensor(list(reversed(splits))))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, to_reference(layer)(x, splits), rtol=0.02, atol=0.02)


def test_empty_inner_dimension_gives_the_bias_or_zeros():
    """in_features == 0 (fprop) or out_features == 0 (dgrad): an empty sum, as F.linear gives it."""
    splits = torch.tensor([8, 0, 8], device="cuda")
    x = torch.randn(16, 0, device="cuda", dtype=torch.bfloat16)
    weights = [torch.empty(64, 0, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    biases = [torch.randn(64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    y = ops.grouped_linear_fprop(x, splits, weights, biases)
    torch.testing.assert_close(y, torch.cat([biases[0].expand(8, 64), biases[2].expand(8, 64)]), rtol=0, atol=0)
    torch.testing.assert_close(ops.grouped_linear_fprop(x, splits, weights, []), torch.zeros(16, 64, device="cuda",
                               dtype=torch.bfloat16), rtol=0, atol=0)
    dy = torch.randn(16, 0, device="cuda", dtype=torch.bfloat16)
    weights_t = [torch.empty(0, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    torch.testing.assert_close(ops.grouped_linear_dgrad(dy, splits, weights_t),
                               torch.zeros(16, 64, device="cuda", dtype=torch.bfloat16), rtol=0, atol=0)


def test_overlapping_targets_add_as_in_sequence():
    """Two experts' main_grads that are overlapping views of one buffer (not the same tensor): the
    launches are split so no two blocks update one word at once; the result is the sequential sums."""
    splits = [40, 24, 0, 64]
    x, gy = _data(splits)
    buffer = torch.zeros(4 * OUT * IN + 8, device="cuda")
    targets = [buffer[0:OUT * IN].view(OUT, IN), buffer[8:8 + OUT * IN].view(OUT, IN),
               buffer[2 * OUT * IN:3 * OUT * IN].view(OUT, IN), buffer[3 * OUT * IN:4 * OUT * IN].view(OUT, IN)]
    ops.grouped_linear_wgrad_accumulate_(gy, x, torch.tensor(splits, device="cuda"), targets, [])
    expected = torch.zeros(4 * OUT * IN + 8, device="cuda", dtype=torch.float64)
    views = [expected[0:OUT * IN].view(OUT, IN), expected[8:8 + OUT * IN].view(OUT, IN),
             expected[2 * OUT * IN:3 * OUT * IN].view(OUT, IN), expected[3 * OUT * IN:4 * OUT * IN].view(OUT, IN)]
    offset = 0
    for view, rows in zip(views, splits):
        view += gy[offset:offset + rows].double().t() @ x[offset:offset + rows].double()
        offset += rows
    torch.testing.assert_close(buffer.double(), expected, rtol=1e-5, atol=1e-4)
