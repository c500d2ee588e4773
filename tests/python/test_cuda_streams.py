"""backward_dw() on a stream other than the one that queued the work (needs a CUDA GPU).

The W step runs its kernels on the stream current at the call; the caller orders that stream after
the work's producer (as for any op on a side stream). splitgrad keeps what it owns — the stashed
input and grad-output, released as soon as the W step has been queued — from the allocator until
that stream has read it. Each test overwrites every block the allocator can hand out again while
the W step is still waiting behind a sleep kernel: gradients must equal the same W step run on
the current stream, bit for bit.
"""

import math

import pytest
import torch

import splitgrad

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (stream semantics of the W step); runs on the GPU machine"
)

TOKENS, WIDTH = 4096, 1024
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: long enough for the current stream to reuse memory
MICRO_BATCHES = 4


def build(dtype, bias, fused, tied):
    """Two delayed layers (the second's weight tied to the first's when `tied`), fixed values."""
    torch.manual_seed(1)
    layers = [
        splitgrad.Linear(WIDTH, WIDTH, bias=bias, params_dtype=dtype, device="cuda", delay_wgrad_compute=True,
                         fuse_wgrad_accumulation=fused)
        for _ in range(2)
    ]
    if tied:
        layers[1].weight = layers[0].weight
    if fused:
        for layer in layers:
            for p in (layer.weight, layer.bias):
                if p is not None and getattr(p, "main_grad", None) is None:
                    p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
    return layers


def queue_micro_batches(layers, dtype, count=MICRO_BATCHES):
    """Forward and backward `count` micro-batches; the stashed input and grad-output of each item are
    temporaries that only splitgrad holds afterwards."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(count):
        x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=dtype, generator=generator)
        out = layers[1](torch.relu(layers[0](x)))
        out.backward(torch.randn(out.shape, device="cuda", dtype=dtype, generator=generator))
        del x, out


def gradients(layers):
    out = {}
    for i, layer in enumerate(layers):
        for name, p in (("weight", layer.weight), ("bias", layer.bias)):
            if p is None:
                continue
            g = getattr(p, "main_grad", None)
            out[f"{i}.{name}"] = (g if g is not None else p.grad).clone()
    return out


def overwrite_freed_memory(dtype, count=16):
    """Allocates on the current stream what the allocator has free and fills it with NaN."""
    return [torch.full((TOKENS, WIDTH), math.nan, device="cuda", dtype=dtype) for _ in range(count)]


def assert_bit_identical(ours, reference):
    assert ours.keys() == reference.keys()
    for name in reference:
        assert torch.isfinite(ours[name]).all(), f"{name}: non-finite values (memory reused under the W step)"
        assert torch.equal(ours[name], reference[name]), (
            f"{name}: differs from the W step on the current stream in "
            f"{(ours[name] != reference[name]).float().mean().item():.2%} of its elements"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_w_on_a_busy_side_stream_reads_what_was_stashed(dtype, bias, fused, tied):
    layers = build(dtype, bias, fused, tied)
    queue_micro_batches(layers, dtype)
    splitgrad.backward_dw_all()  # on the current stream: the reference
    torch.cuda.synchronize()
    reference = gradients(layers)

    layers = build(dtype, bias, fused, tied)
    queue_micro_batches(layers, dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for _ in range(MICRO_BATCHES):
            layers[1].backward_dw()
            layers[0].backward_dw()
    junk = overwrite_freed_memory(dtype)  # the current stream runs ahead of the sleeping side stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    del junk
    assert_bit_identical(gradients(layers), reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_dw_all_on_a_side_stream(dtype):
    layers = build(dtype, bias=True, fused=False, tied=True)
    queue_micro_batches(layers, dtype, count=3)
    splitgrad.backward_dw_all()
    torch.cuda.synchronize()
    reference = gradients(layers)

    layers = build(dtype, bias=True, fused=False, tied=True)
    queue_micro_batches(layers, dtype, count=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        splitgrad.backward_dw_all()
    junk = overwrite_freed_memory(dtype)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    del junk
    assert_bit_identical(gradients(layers), reference)


@pytest.mark.parametrize("fused", [False, True])
def test_two_layers_w_on_two_streams_at_once(fused):
    dtype = torch.bfloat16
    layers = build(dtype, bias=True, fused=fused, tied=False)
    queue_micro_batches(layers, dtype)
    splitgrad.backward_dw_all()
    torch.cuda.synchronize()
    reference = gradients(layers)

    layers = build(dtype, bias=True, fused=fused, tied=False)
    queue_micro_batches(layers, dtype)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    # Interleaved host calls: each stream's kernels (and its cuBLASLt workspace, and the bias
    # kernel's partial sums in it) run concurrently with the other's.
    for _ in range(MICRO_BATCHES):
        for layer, stream in zip(layers, streams):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES // 8)
                layer.backward_dw()
    junk = overwrite_freed_memory(dtype)
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    del junk
    assert_bit_identical(gradients(layers), reference)


def test_pipelining_w_step_on_a_side_stream():
    """The per-pass W step a pipeline stage runs (LayerHandle.backward_dw_pass) is stream-safe too."""
    dtype = torch.bfloat16
    layers = build(dtype, bias=True, fused=True, tied=False)
    queue_micro_batches(layers, dtype, count=2)
    splitgrad.backward_dw_all()
    torch.cuda.synchronize()
    reference = gradients(layers)

    layers = build(dtype, bias=True, fused=True, tied=False)
    queue_micro_batches(layers, dtype, count=2)
    passes = layers[0]._layer.pending_passes()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for pass_id in reversed(passes):  # the newest micro-batch first, as a schedule may
            for layer in reversed(layers):
                layer._layer.backward_dw_pass(pass_id)
    junk = overwrite_freed_memory(dtype)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    del junk
    ours = gradients(layers)
    for name in reference:  # fp32 main_grad: two micro-batches added in the other order
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(ours[name]).all()
