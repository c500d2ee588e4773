"""splitgrad::activation and activation_backward on CUDA (src/cuda/activation_cuda.cu) against the ATen
composite they replace, bit for bit: the gated activations' fused kernels (bf16 / fp16 / fp32, the
16-byte and the scalar paths) and the fallback for everything else.

The forward must equal ``act(a) * b`` exactly (LayerNormMLP's recomputed forward and its delayed and
immediate gradients are compared bit for bit with plain PyTorch), and so must the backward equal
torch.autograd of that composite: the kernels round where ATen materialises a tensor.
"""

import pytest
import torch
from sg_helpers import ref_activation

import splitgrad  # noqa: F401  (registers torch.ops.splitgrad)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused activation kernels); runs on the GPU machine"
)

OPS = torch.ops.splitgrad
GATED = ["geglu", "reglu", "swiglu"]
PLAIN = ["gelu", "relu", "silu"]
# TE's other activations: the ATen composite on CUDA too (no fused kernel)
COMPOSITE = ["qgelu", "srelu", "qgeglu", "sreglu", "glu"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Input shapes (last dim 2n): no rows, one row, odd n, n = 1, n a multiple of 4 but not 8 (fp32's
# 16-byte path, bf16's scalar one), n a multiple of 8, wide rows, 3-D.
SHAPES = [(0, 16), (1, 16), (5, 14), (7, 2), (9, 24), (33, 128), (17, 2 * 1032), (3, 4, 48), (2, 0, 16)]


def make_input(shape, dtype, seed=0):
    """Values over the activations' interesting range (both signs, |x| up to ~12)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (3 * torch.randn(shape, generator=g, device="cuda")).to(dtype)


def reference(name, x, grad):
    """The composite forward and torch.autograd's gradient of it."""
    x = x.detach().requires_grad_(True)
    y = ref_activation(name, x)
    (dx,) = torch.autograd.grad(y, x, grad) if y.numel() else (torch.zeros_like(x),)
    return y.detach(), dx


def output_grad(name, x, seed=1):
    shape = list(x.shape)
    if name in GATED or name in ("qgeglu", "sreglu", "glu"):
        shape[-1] //= 2
    return make_input(shape, x.dtype, seed)


def assert_bitwise(what, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
    if not torch.equal(got, want):
        diff = got.double() - want.double()
        ulps = (got.float() != want.float()).sum().item()
        raise AssertionError(f"{what}: {ulps} of {got.numel()} elements differ, max |diff| "
                             f"{diff.abs().max().item():.3g} (max |value| {want.abs().max().item():.3g})")


def test_the_cuda_kernels_are_registered():
    for op in ("splitgrad::activation", "splitgrad::activation_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", GATED)
def test_gated_forward_and_backward_equal_the_aten_composite(name, dtype, shape):
    x = make_input(shape, dtype)
    grad = output_grad(name, x)
    want_y, want_dx = reference(name, x, grad)
    y = OPS.activation(x, name)
    assert_bitwise(f"{name} {dtype} {shape} forward", y, want_y)
    dx = OPS.activation_backward(grad, x, name)
    assert_bitwise(f"{name} {dtype} {shape} backward", dx, want_dx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", COMPOSITE)
def test_other_te_activations_equal_the_aten_composite_on_cuda(name, dtype):
    for shape in [(5, 14), (33, 128), (3, 4, 48)]:
        x = make_input(shape, dtype)
        grad = output_grad(name, x)
        want_y, want_dx = reference(name, x, grad)
        assert_bitwise(f"{name} {dtype} {shape} forward", OPS.activation(x, name), want_y)
        assert_bitwise(f"{name} {dtype} {shape} backward", OPS.activation_backward(grad, x, name), want_dx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", GATED)
def test_misaligned_contiguous_tensors_take_the_scalar_path(name, dtype):
    """Contiguous views one element into their storage: no 16-byte loads, the same results."""
    shape, rows = (33, 2 * 64), 33
    x = make_input((rows * shape[1] + 1,), dtype)[1:].view(shape)
    grad = make_input((rows * shape[1] // 2 + 1,), dtype, seed=1)[1:].view(rows, shape[1] // 2)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    want_y, want_dx = reference(name, x, grad)
    assert_bitwise("forward", OPS.activation(x, name), want_y)
    assert_bitwise("backward", OPS.activation_backward(grad, x, name), want_dx)


@pytest.mark.parametrize("name", GATED)
def test_special_values(name):
    """Zeros of both signs, infinities, NaN and extremes go through the same formulas as ATen's."""
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 10.0, -10.0, 88.0, -88.0, 100.0, -100.0, 3e38, -3e38,
                             float("inf"), float("-inf"), float("nan"), 1.0], device="cuda")
    a = specials.repeat(16)
    b = specials.repeat_interleave(16)
    for dtype in DTYPES:
        x = torch.cat([a, b]).view(1, -1).to(dtype)
        grad = make_input((1, a.numel()), dtype)
        want_y, want_dx = reference(name, x, grad)
        y, dx = OPS.activation(x, name), OPS.activation_backward(grad, x, name)
        # NaN == NaN here: the same positions must be NaN.
        assert torch.equal(y.isnan(), want_y.isnan()) and torch.equal(dx.isnan(), want_dx.isnan()), dtype
        assert_bitwise(f"{dtype} forward", y.nan_to_num(0.0), want_y.nan_to_num(0.0))
        assert_bitwise(f"{dtype} backward", dx.nan_to_num(0.0), want_dx.nan_to_num(0.0))


def test_many_rows_take_the_grid_stride_loop():
    """More rows than one grid's y dimension holds (65535 blocks of one row at 2048 bf16 columns)."""
    x = make_input((66000, 2 * 2048), torch.bfloat16)
    grad = output_grad("swiglu", x)
    want_y, want_dx = reference("swiglu", x, grad)
    assert_bitwise("forward", OPS.activation(x, "swiglu"), want_y)
    assert_bitwise("backward", OPS.activation_backward(grad, x, "swiglu"), want_dx)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("name", PLAIN + GATED)
def test_non_contiguous_inputs_fall_back_to_aten(name, dtype):
    base = make_input((2 * 24, 10), dtype)
    x = base.t()  # [10, 48], not contiguous
    grad = output_grad(name, x).t().contiguous().t() if name in PLAIN else output_grad(name, x)
    assert not x.is_contiguous()
    want_y, want_dx = reference(name, x, grad)
    assert_bitwise("forward", OPS.activation(x, name), want_y)
    assert_bitwise("backward", OPS.activation_backward(grad, x, name), want_dx)
    # A non-contiguous gradient with a contiguous input.
    xc = x.contiguous()
    grad_t = output_grad(name, xc)
    grad_nc = grad_t.t().contiguous().t() if grad_t.shape[0] > 1 else grad_t
    _, want_dx = reference(name, xc, grad_nc)
    assert_bitwise("backward, strided grad", OPS.activation_backward(grad_nc, xc, name), want_dx)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("name", PLAIN)
def test_plain_activations_equal_aten(name, dtype):
    x = make_input((7, 33), dtype)
    grad = output_grad(name, x)
    want_y, want_dx = reference(name, x, grad)
    assert_bitwise("forward", OPS.activation(x, name), want_y)
    assert_bitwise("backward", OPS.activation_backward(grad, x, name), want_dx)


@pytest.mark.parametrize("name", GATED)
def test_float64_gated_falls_back_to_aten(name):
    x = make_input((5, 2 * 8), torch.float64)
    grad = output_grad(name, x)
    want_y, want_dx = reference(name, x, grad)
    assert_bitwise("forward", OPS.activation(x, name), want_y)
    assert_bitwise("backward", OPS.activation_backward(grad, x, name), want_dx)


def test_runs_on_the_current_stream():
    """The inputs are written on a side stream after a long sleep: kernels on any other stream would
    read them before they are there."""
    x = make_input((64, 2 * 256), torch.bfloat16)
    grad = output_grad("swiglu", x)
    want_y, want_dx = reference("swiglu", x, grad)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        x_late, grad_late = x.clone(), grad.clone()
        y = OPS.activation(x_late, "swiglu")
        dx = OPS.activation_backward(grad_late, x_late, "swiglu")
    torch.cuda.current_stream().wait_stream(stream)
    assert_bitwise("forward", y, want_y)
    assert_bitwise("backward", dx, want_dx)


def test_bad_arguments_are_refused():
    """The CUDA kernels check with the ATen back end's checks: one set of messages."""
    x = make_input((4, 16), torch.bfloat16)
    with pytest.raises(ValueError, match='splitgrad::activation: expected activation .* got "swish"'):
        OPS.activation(x, "swish")
    with pytest.raises(ValueError, match='splitgrad::activation_backward: expected activation .* got "swish"'):
        OPS.activation_backward(x[:, :8], x, "swish")
    with pytest.raises(ValueError, match=r'"swiglu" expects an even last dimension .* got shape \[4, 15\]'):
        OPS.activation(make_input((4, 15), torch.bfloat16), "swiglu")
    with pytest.raises(ValueError, match=r"expected grad_output of shape \[4, 8\] .* got \[4, 16\]"):
        OPS.activation_backward(x, x, "geglu")
