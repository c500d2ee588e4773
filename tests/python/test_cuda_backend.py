"""The cuBLASLt back end against PyTorch's own GEMMs (needs a CUDA GPU; skipped on the CPU).

Low-precision results are judged against a float64 reference, with an error bound relative to
PyTorch's own error on the same inputs (as flash-attention's tests do).
"""

import pytest
import torch
import torch.nn.functional as F

import splitgrad

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the cuBLASLt back end); runs on the GPU machine"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [  # (tokens, in_features, out_features): odd sizes, one token, empty inputs
    (0, 16, 24),
    (1, 64, 32),
    (7, 17, 33),
    (129, 100, 1),
    (256, 1, 48),
    (333, 96, 130),
]


def assert_close_to_reference(ours, torch_result, reference, name):
    """|ours - ref| may exceed PyTorch's own |torch - ref| by at most 2x plus a tiny floor."""
    assert ours.shape == reference.shape, f"{name}: shape {tuple(ours.shape)} vs {tuple(reference.shape)}"
    assert ours.dtype == torch_result.dtype, f"{name}: dtype {ours.dtype} vs {torch_result.dtype}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    if reference.numel() == 0:
        return
    ours_error = (ours.double() - reference).abs().max().item()
    torch_error = (torch_result.double() - reference).abs().max().item()
    scale = reference.abs().max().item() + 1.0
    assert ours_error <= 2 * torch_error + 1e-6 * scale, (
        f"{name}: error {ours_error:.3e} vs PyTorch's {torch_error:.3e} (reference scale {scale:.3e})"
    )


def random(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,in_features,out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_torch(dtype, tokens, in_features, out_features, with_bias):
    x = random(tokens, in_features, dtype=dtype)
    w = random(out_features, in_features, dtype=dtype)
    b = random(out_features, dtype=dtype) if with_bias else None
    dy = random(tokens, out_features, dtype=dtype)

    y = torch.ops.splitgrad.linear_fprop(x, w, b)
    y_ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_close_to_reference(y, F.linear(x, w, b), y_ref, "fprop")

    dx = torch.ops.splitgrad.linear_dgrad(dy, w)
    assert_close_to_reference(dx, dy @ w, dy.double() @ w.double(), "dgrad")

    dw, db = torch.ops.splitgrad.linear_wgrad(dy, x, with_bias)
    assert_close_to_reference(dw, dy.t() @ x, dy.double().t() @ x.double(), "wgrad")
    if with_bias:
        assert_close_to_reference(db, dy.sum(0), dy.double().sum(0), "bias grad")
    else:
        assert db.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_wgrad_accumulates_into_fp32_main_grad_in_place(dtype, with_bias):
    tokens, in_features, out_features = 1024, 256, 384
    x = random(tokens, in_features, dtype=dtype)
    dy = random(tokens, out_features, dtype=dtype)
    main_grad = torch.randn(out_features, in_features, device="cuda")
    bias_main_grad = torch.randn(out_features, device="cuda") if with_bias else None
    expected = main_grad.double() + dy.double().t() @ x.double()
    expected_bias = bias_main_grad.double() + dy.double().sum(0) if with_bias else None
    pointer = main_grad.data_ptr()

    # Warm-up on copies: cuBLASLt plans and the workspace are made once, outside the measurement.
    torch.ops.splitgrad.linear_wgrad_accumulate_(
        dy, x, main_grad.clone(), None if bias_main_grad is None else bias_main_grad.clone()
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x, main_grad, bias_main_grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before

    assert main_grad.data_ptr() == pointer, "main_grad was replaced instead of written in place"
    # No temporary at all: dW goes straight into main_grad (beta = 1), db straight into its target,
    # the bias kernel's partial sums into the cuBLASLt workspace.
    assert extra == 0, f"{extra} bytes allocated during the fused wgrad (bias: {with_bias})"
    tolerance = 1e-2 if dtype != torch.float32 else 2e-3
    torch.testing.assert_close(main_grad.double(), expected, rtol=tolerance, atol=tolerance)
    if with_bias:
        torch.testing.assert_close(bias_main_grad.double(), expected_bias, rtol=tolerance, atol=tolerance)


def test_non_contiguous_operands():
    x = random(64, 96, dtype=torch.bfloat16).t()  # [96, 64], column-major
    w = random(48, 64, dtype=torch.bfloat16)
    y = torch.ops.splitgrad.linear_fprop(x, w, None)
    assert_close_to_reference(y, F.linear(x, w), F.linear(x.double(), w.double()), "fprop, transposed x")
    wide = random(32, 200, dtype=torch.bfloat16)[:, 10:74]  # row stride 200 > 64 columns
    y = torch.ops.splitgrad.linear_fprop(wide, w, None)
    assert_close_to_reference(y, F.linear(wide, w), F.linear(wide.double(), w.double()), "fprop, strided rows")
    dy = random(32, 48, dtype=torch.bfloat16)
    dw, _ = torch.ops.splitgrad.linear_wgrad(dy, wide, False)
    assert_close_to_reference(dw, dy.t() @ wide, dy.double().t() @ wide.double(), "wgrad, strided rows")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tied_delayed_model_matches_autograd_on_cuda(dtype):
    torch.manual_seed(0)
    layers = [splitgrad.Linear(64, 64, params_dtype=dtype, device="cuda", delay_wgrad_compute=True) for _ in range(3)]
    layers[2].weight = layers[0].weight
    layers[1].bias = layers[0].bias
    reference = [torch.nn.Linear(64, 64, dtype=dtype, device="cuda") for _ in range(3)]
    for ours, ref in zip(layers, reference):
        ref.load_state_dict(ours.state_dict())
    reference[2].weight = reference[0].weight
    reference[1].bias = reference[0].bias
    x = random(16, 64, dtype=dtype)
    for micro_batch in range(2):
        h, r = x, x
        for ours, ref in zip(layers, reference):
            h, r = torch.tanh(ours(h)), torch.tanh(ref(r))
        h.float().square().sum().backward()
        r.float().square().sum().backward()
    splitgrad.backward_dw_all()
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for ours, ref in zip(layers, reference):
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **tolerance)
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **tolerance)


BIAS_SHAPES = [  # (tokens, features): around the kernel's 8-column vectors, 256-column tiles, 8 row lanes
    (0, 24), (1, 1), (1, 256), (7, 7), (8, 8), (9, 255), (64, 257), (1000, 1000), (8193, 264), (20000, 8),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,features", BIAS_SHAPES)
def test_bias_gradient_kernel_shapes(dtype, tokens, features):
    """db = Σ dy, written (linear_wgrad) and added into fp32 main_grad (linear_wgrad_accumulate_),
    against a float64 reference with PyTorch's own error as the yardstick."""
    dy = random(tokens, features, dtype=dtype)
    x = random(tokens, 4, dtype=dtype)
    reference = dy.double().sum(0)
    _, db = torch.ops.splitgrad.linear_wgrad(dy, x, True)
    assert_close_to_reference(db, dy.sum(0), reference, "bias grad, written")
    start = torch.randn(features, device="cuda")
    bias_main_grad = start.clone()
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x, torch.zeros(features, 4, device="cuda"), bias_main_grad)
    assert_close_to_reference(bias_main_grad, start + dy.float().sum(0), start.double() + reference,
                              "bias grad, added to main_grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bias_gradient_kernel_strided_and_misaligned_rows(dtype):
    """Rows whose stride is not a multiple of 16 bytes, a start 2 bytes off alignment, and a row
    stride larger than the row: the scalar path, and the vector path with a long stride."""
    base = random(300, 203, dtype=dtype)
    for name, dy in (("odd row stride", base[:, :200]), ("misaligned start", base[:, 1:201]),
                     ("aligned, long stride", random(300, 264, dtype=dtype)[:, :256])):
        x = random(dy.shape[0], 8, dtype=dtype)
        _, db = torch.ops.splitgrad.linear_wgrad(dy, x, True)
        assert_close_to_reference(db, dy.sum(0), dy.double().sum(0), f"bias grad, {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_delayed_bias_gradient_is_bit_identical_to_immediate(dtype):
    """With an existing .grad in a 16-bit dtype: the immediate path adds a rounded db with
    autograd's add; the deferred path must round and add the same way (TE's test_numerics demand)."""
    torch.manual_seed(0)
    immediate = splitgrad.Linear(96, 80, params_dtype=dtype, device="cuda")
    delayed = splitgrad.Linear(96, 80, params_dtype=dtype, device="cuda", delay_wgrad_compute=True)
    delayed.load_state_dict(immediate.state_dict())
    start = random(80, dtype=dtype)
    immediate.bias.grad, delayed.bias.grad = start.clone(), start.clone()
    x = random(333, 96, dtype=dtype)
    g = random(333, 80, dtype=dtype)
    immediate(x).backward(g)
    delayed(x).backward(g)
    delayed.backward_dw()
    assert torch.equal(delayed.bias.grad, immediate.bias.grad)
    # (the weight's GEMM runs with beta = 1 into zeros when deferred, beta = 0 when immediate: the
    # heuristic may pick another kernel, so only closeness is promised there)
    torch.testing.assert_close(delayed.weight.grad, immediate.weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "cuda-graph"])
def test_bias_gradient_beside_the_gemm_on_a_side_stream(dtype, capture):
    """From 2**21 elements of dy the column sum runs on a side stream during the wgrad GEMM. Its
    result must equal the same kernel's one-after-the-other result bit for bit (the bias-only call
    runs it alone), be complete when the caller's stream reads it (a user stream, dy freshly written
    after a sleep so a missing fork or join reads stale data), and replay from a CUDA graph."""
    tokens, fin, fout = 4096, 512, 1024  # dy: 4096 x 1024 = 2**22 elements
    x, dy = random(tokens, fin, dtype=dtype), random(tokens, fout, dtype=dtype)
    weight_alone, bias_alone = torch.zeros(fout, fin, device="cuda"), torch.randn(fout, device="cuda")
    weight_target, bias_target = weight_alone.clone(), bias_alone.clone()
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x, weight_alone, None)
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x[:, :0], weight_alone[:, :0], bias_alone)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        late_dy = torch.zeros_like(dy)
        torch.cuda._sleep(20_000_000)
        late_dy.copy_(dy)
        if capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                torch.ops.splitgrad.linear_wgrad_accumulate_(late_dy, x, weight_target, bias_target)
            graph.replay()
        else:
            torch.ops.splitgrad.linear_wgrad_accumulate_(late_dy, x, weight_target, bias_target)
        bias_seen = bias_target.clone()
        weight_seen = weight_target.clone()
    torch.cuda.synchronize()
    assert torch.equal(bias_seen, bias_alone)
    assert torch.equal(weight_seen, weight_alone)
    _, fresh_bias = torch.ops.splitgrad.linear_wgrad(dy, x, True)
    _, reference_bias = torch.ops.splitgrad.linear_wgrad(dy[:, :], x[:, :0], True)
    assert torch.equal(fresh_bias, reference_bias)


def _large_dy(layout, dtype):
    """A dy of at least 2**21 elements (the side-stream path) in the given layout."""
    if layout == "odd":  # odd token and feature counts: the kernel's scalar tails
        return random(4099, 517, dtype=dtype)
    if layout == "strided":  # rows longer than the features
        return random(4096, 1032, dtype=dtype)[:, :1000]
    flat = random(4096 * 1000 + 1, dtype=dtype)  # "misaligned": a start 2 or 4 bytes off 16
    return flat[1:].view(4096, 1000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["odd", "strided", "misaligned"])
def test_bias_gradient_beside_the_gemm_odd_strided_misaligned(dtype, layout):
    """The side-stream path on odd, strided and misaligned dy: the same bits as the weight GEMM and
    the column sum run one after the other (each alone), and close to a float64 reference."""
    dy = _large_dy(layout, dtype)
    assert dy.numel() >= 2**21
    x = random(dy.shape[0], 48, dtype=dtype)[:, 8:41]  # strided x too
    start_w, start_b = torch.randn(dy.shape[1], 33, device="cuda"), torch.randn(dy.shape[1], device="cuda")
    weight_alone, bias_alone = start_w.clone(), start_b.clone()
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x, weight_alone, None)
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x[:, :0], weight_alone[:, :0], bias_alone)
    weight_both, bias_both = start_w.clone(), start_b.clone()
    torch.ops.splitgrad.linear_wgrad_accumulate_(dy, x, weight_both, bias_both)
    assert torch.equal(bias_both, bias_alone)
    assert torch.equal(weight_both, weight_alone)
    reference = start_b.double() + dy.double().sum(0)
    assert_close_to_reference(bias_both, start_b + dy.float().sum(0), reference, f"bias grad, {layout}")
    _, written = torch.ops.splitgrad.linear_wgrad(dy, x, True)
    assert_close_to_reference(written, dy.sum(0), dy.double().sum(0), f"bias grad written, {layout}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_delayed_equals_immediate_bit_for_bit_on_the_side_stream_path(dtype):
    """A fused main_grad over two micro-batches whose dy takes the side-stream path: the deferred
    wgrad and bias gradient equal the immediate ones bit for bit (TE's test_numerics demand)."""
    torch.manual_seed(0)
    kwargs = dict(params_dtype=dtype, device="cuda", fuse_wgrad_accumulation=True)
    immediate = splitgrad.Linear(520, 1024, **kwargs)
    delayed = splitgrad.Linear(520, 1024, delay_wgrad_compute=True, **kwargs)
    delayed.load_state_dict(immediate.state_dict())
    for layer in (immediate, delayed):
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda")
    for _ in range(2):
        x, g = random(4096, 520, dtype=dtype), random(4096, 1024, dtype=dtype)  # dy: 2**22 elements
        immediate(x).backward(g)
        delayed(x).backward(g)
        delayed.backward_dw()
    assert torch.equal(delayed.weight.main_grad, immediate.weight.main_grad)
    assert torch.equal(delayed.bias.main_grad, immediate.bias.main_grad)
    assert immediate.bias.main_grad.abs().sum() > 0
