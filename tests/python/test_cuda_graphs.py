"""CUDA graphs: a training step of splitgrad layers — forward, backward, every backward_dw(), fused
main_grad, biases, a tied weight — captured once with torch.cuda.graph and replayed gives, bit for
bit, what the same steps give eagerly (needs a GPU; skipped on the CPU).

What the README promises under capture: the deferred work is queued and run while the step is
captured (the host bookkeeping happens then, once), so the graph replays the kernels alone: fused
``main_grad`` accumulates on every replay as it does eagerly; a ``.grad`` that did not exist when the
step was captured is created in the graph's memory and holds each replay's gradient (as autograd's
own ``.grad`` does under whole-network capture). Grad-ready hooks run at capture, once per
parameter, after its last contribution; whatever they enqueue on the stream (a collective, a copy)
is captured with the step and replays with it, while their Python side effects happen only then.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import splitgrad

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs); runs on the GPU machine"
)

WIDTH, TOKENS, STEPS = 256, 512, 4


def make_model(fused=True):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        splitgrad.Linear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=True,
                         fuse_wgrad_accumulation=fused)
        for _ in range(4)
    )
    layers[2].weight = layers[0].weight  # tied
    if fused:
        for i, layer in enumerate(layers):
            if getattr(layer.weight, "main_grad", None) is None:
                layer.weight.main_grad = torch.zeros(WIDTH, WIDTH, device="cuda")
            if i % 2 == 0:  # half the biases accumulate into main_grad, the others into .grad
                layer.bias.main_grad = torch.zeros(WIDTH, device="cuda")
    return layers


def forward(layers, x):
    h = x
    for layer in layers:
        h = torch.nn.functional.gelu(layer(h))
    return h


def step(layers, x):
    forward(layers, x).float().square().mean().backward()
    for layer in reversed(layers):
        layer.backward_dw()


def parameters(layers):
    return list({id(p): p for p in layers.parameters()}.values())


def snapshot(layers):
    out = []
    for p in parameters(layers):
        g = getattr(p, "main_grad", None)
        out.append((g if g is not None else p.grad).clone())
    return out


def clear_grads(layers):
    for p in parameters(layers):
        p.grad = None


def data(steps=STEPS):
    generator = torch.Generator(device="cuda").manual_seed(5)
    return [torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(steps)]


def capture(layers, static_x, body):
    """torch.cuda.graph's recipe: warm up on a side stream, reset the gradients, capture once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p in parameters(layers):
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    clear_grads(layers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    assert splitgrad.pending_wgrads() == 0
    return graph


@pytest.mark.parametrize("fused", [True, False])
def test_captured_step_replays_bit_identical_to_eager_steps(fused):
    inputs = data()
    eager = make_model(fused)
    graphed = make_model(fused)
    expected = []
    for x in inputs:
        clear_grads(eager)  # a .grad is each step's gradient; main_grad accumulates
        step(eager, x)
        expected.append(snapshot(eager))

    static_x = torch.zeros_like(inputs[0])
    graph = capture(graphed, static_x, lambda: step(graphed, static_x))
    for i, x in enumerate(inputs):
        static_x.copy_(x)
        graph.replay()
        got = snapshot(graphed)
        for j, (a, b) in enumerate(zip(got, expected[i])):
            assert torch.equal(a, b), f"step {i}, parameter {j}: the replay differs from the eager step"
    assert len(set(float(g.abs().sum()) for g in expected[-1])) > 1  # gradients are not trivial


def test_captured_micro_batches_with_interleaved_w():
    """F0 B0 F1 W0 B1 W1 inside one graph: the per-pass W of a pipeline schedule, captured."""
    inputs = data(2 * STEPS)
    eager, graphed = make_model(), make_model()

    def micro_batches(layers, x0, x1):
        forward(layers, x0).float().square().mean().backward()
        out1 = forward(layers, x1)
        for layer in reversed(layers):
            layer.backward_dw()
        out1.float().square().mean().backward()
        for layer in reversed(layers):
            layer.backward_dw()

    for s in range(STEPS):
        clear_grads(eager)  # a .grad holds the last step's gradient, as under the graph
        micro_batches(eager, inputs[2 * s], inputs[2 * s + 1])
    expected = snapshot(eager)
    static = [torch.zeros_like(inputs[0]), torch.zeros_like(inputs[0])]
    graph = capture(graphed, static[0], lambda: micro_batches(graphed, *static))
    for s in range(STEPS):
        static[0].copy_(inputs[2 * s])
        static[1].copy_(inputs[2 * s + 1])
        graph.replay()
    for a, b in zip(snapshot(graphed), expected):
        assert torch.equal(a, b)


def test_grad_ready_hooks_run_at_capture_not_at_replay():
    layers = make_model()
    calls = []
    for p in parameters(layers):
        splitgrad.register_grad_ready_hook(p, lambda param: calls.append(id(param)))
    static_x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16)
    graph = capture(layers, static_x, lambda: step(layers, static_x))
    # two warm-up steps and the capture: once per parameter per pass, after its last contribution
    assert sorted(calls) == sorted(3 * [id(p) for p in parameters(layers)])
    calls.clear()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert calls == []


def test_a_hook_that_enqueues_work_is_replayed_with_the_graph():
    """A hook's stream work is captured with the step: here it copies the finished main_grad out."""
    layers = make_model()
    tied = layers[0].weight
    copies = []

    def copy_out(param):
        copies.append(param.main_grad.clone())  # enqueued on the capturing stream at capture

    splitgrad.register_grad_ready_hook(tied, copy_out)
    static_x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16)
    graph = capture(layers, static_x, lambda: step(layers, static_x))
    captured_copy = copies[-1]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured_copy, tied.main_grad)  # refreshed by each replay


def test_grad_reducer_step_under_a_graph():
    """A GradReducer step (NCCL, one GPU) captured with forward, backward and backward_dw(): the
    all-reduces launched by the grad-ready hooks at capture replay with the graph."""
    worker = Path(__file__).parent / "workers" / "cuda_graph_reducer.py"
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["launches_at_capture"] > 0
    assert result["launches_during_replays"] == 0
    assert result["identical"], result


def test_te_style_hook_of_a_graphed_layer_tied_to_an_eager_one():
    """make_graphed_callables replays the layer's backward without its op, so its passes cannot name
    it: the capture marks it (ran_untracked), and a pass through the graphed layer and an eager
    layer holding all its parameters still calls its no-argument hook once."""
    m = splitgrad.Linear(WIDTH, WIDTH, device="cuda")
    n = splitgrad.Linear(WIDTH, WIDTH, device="cuda")
    n.weight, n.bias = m.weight, m.bias
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(m.weight.grad.clone()))
    x = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(m, (x,))
    assert m._layer.ran_untracked and not n._layer.ran_untracked
    assert calls == [], "warm-up and capture take gradients with autograd.grad"
    n(graphed(x)).sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(calls[0], m.weight.grad, rtol=0, atol=0)
