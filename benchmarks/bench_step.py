"""A training step of an 8-layer MLP block and the host overhead of splitgrad's calls, side by side
with the regular (non-delayed) path and plain PyTorch.

1. Step: hidden 4096, 8192 tokens, bf16 parameters with fp32 main_grad:
   delayed (backward, then backward_dw of every layer) vs regular (wgrad inside backward) vs plain
   nn.Linear whose .grad is added into main_grad (main_grad.add_) — time and peak memory.
2. Host overhead on tiny shapes (16 x 16, 4 tokens), 1 / 32 / 128 layers: CPU microseconds per
   forward and per backward_dw(), against the same deferred step written in plain PyTorch (a Python
   autograd.Function that queues (x, dy) and later runs mm + add_).

    python benchmarks/bench_step.py [--device cuda] [--out out]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import device_description, host_seconds, peak_memory_bytes, print_table, time_side_by_side, write_results  # noqa: E402

import splitgrad  # noqa: E402


def mlp_layers(kind: str, hidden: int, count: int, device) -> list[nn.Module]:
    layers = []
    for _ in range(count):
        if kind == "plain":
            layer = nn.Linear(hidden, hidden, dtype=torch.bfloat16, device=device)
        else:
            layer = splitgrad.Linear(hidden, hidden, params_dtype=torch.bfloat16, device=device,
                                     delay_wgrad_compute=(kind == "delayed"), fuse_wgrad_accumulation=True)
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, device=device, dtype=torch.float32)
        layers.append(layer)
    return layers


def mlp_step(kind: str, layers, x):
    h = x
    for layer in layers:
        h = F.gelu(layer(h))
    h.float().square().mean().backward()
    if kind == "delayed":
        for layer in reversed(layers):
            layer.backward_dw()
    elif kind == "plain":  # Megatron without fused accumulation: .grad, then add into main_grad
        for layer in layers:
            for p in layer.parameters():
                p.main_grad.add_(p.grad)
                p.grad = None


def bench_mlp(args, results):
    rows = []
    device = torch.device("cuda")
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    kinds = ["delayed", "regular", "plain"]
    stacks = {kind: mlp_layers(kind, args.hidden, args.layers, device) for kind in kinds}
    steps = {kind: functools.partial(mlp_step, kind, stacks[kind], x) for kind in kinds}
    print("MLP training step: timing the three variants side by side", flush=True)
    times = time_side_by_side(steps, min_ms=300)
    memory = {kind: peak_memory_bytes(steps[kind]) for kind in tqdm(kinds, desc="MLP step peak memory", unit="variant")}
    del stacks, steps
    torch.cuda.empty_cache()
    flop = 3 * 2.0 * args.tokens * args.hidden * args.hidden * args.layers
    for kind in ("delayed", "regular", "plain"):
        rows.append([kind, f"{times[kind]:.2f}", f"{flop / (times[kind] * 1e-3) / 1e12:.0f}",
                     f"{times[kind] / times['regular']:.3f}", f"{times[kind] / times['plain']:.3f}", f"{memory[kind] / 2**30:.2f}"])
    results["mlp_step"] = {"ms": times, "peak_bytes": memory, "hidden": args.hidden, "tokens": args.tokens, "layers": args.layers}
    title = f"{args.layers}-layer MLP step, hidden {args.hidden}, {args.tokens} tokens, bf16, fp32 main_grad"
    return print_table(title, ["variant", "ms", "TFLOP/s", "vs regular", "vs plain", "peak GiB above start"], rows)


class QueuedLinear(torch.autograd.Function):
    """The plain-PyTorch way to defer wgrad: queue (x, dy) in Python, run mm + add_ later."""

    queue: list = []

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        QueuedLinear.queue.append((weight, x, dy))
        return dy @ weight, None


class QueuedLinearModule(nn.Module):
    """QueuedLinear as a module, so both sides pay nn.Module's call overhead."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return QueuedLinear.apply(x, self.weight)


def python_backward_dw():
    weight, x, dy = QueuedLinear.queue.pop(0)
    weight.main_grad.add_(dy.t() @ x)


def graphed_w_seconds(layers, reps):
    """Host seconds per layer per W step when the backward_dw() of every layer is captured once in a
    CUDA graph and replayed. Each layer gets an input and a grad-output held here, so what the graph
    reads stays alive; the replay's result is checked against dyᵀ·x."""
    inputs = [torch.randn(4, 16, device="cuda") for _ in layers]
    grads = [torch.randn(4, 16, device="cuda") for _ in layers]

    def queue():
        torch.autograd.backward([layer(x) for layer, x in zip(layers, inputs)], grads)

    def run_w():
        for layer in reversed(layers):
            layer.backward_dw()

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        queue()
        run_w()  # warm-up on the capturing stream
        queue()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            run_w()
    torch.cuda.synchronize()
    before = layers[0].weight.main_grad.clone()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(layers[0].weight.main_grad - before, grads[0].t() @ inputs[0], rtol=1e-4, atol=1e-4)
    total, done = 0.0, 0
    while done < reps:
        batch = min(64, reps - done)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batch):
            graph.replay()
        total += time.perf_counter() - start
        done += batch
    torch.cuda.synchronize()
    return total / (reps * len(layers))


def bench_host(args, results):
    device = torch.device(args.device)
    rows = []
    for count in tqdm([1, 32, 128], desc="host overhead", unit="model"):
        ours = [splitgrad.Linear(16, 16, bias=False, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
                for _ in range(count)]
        weights = [nn.Parameter(torch.randn(16, 16, device=device)) for _ in range(count)]
        queued = [QueuedLinearModule(w) for w in weights]
        for p in [l.weight for l in ours] + weights:
            p.main_grad = torch.zeros(16, 16, device=device)
        x = torch.randn(4, 16, device=device, requires_grad=True)

        def forward_ours():
            h = x
            for layer in ours:
                h = layer(h)
            return h

        def forward_python():
            h = x
            for module in queued:
                h = module(h)
            return h

        def forward_plain():
            h = x
            for w in weights:
                h = F.linear(h, w)
            return h

        reps = max(3, 2000 // count)
        fwd_ours = host_seconds(forward_ours, reps) / count
        fwd_python = host_seconds(forward_python, reps) / count
        fwd_plain = host_seconds(forward_plain, reps) / count

        # backward_dw: in batches of at most 64 passes, queue the backward passes (untimed, with a
        # dense grad-output so every dy is dense), then time draining them layer by layer; the GPU
        # is drained between batches, so a full launch queue never makes the host wait.
        grad_out = torch.randn(4, 16, device=device)

        def time_backward_dw(forward, drain_one_pass):
            total, done = 0.0, 0
            while done < reps:
                batch = min(64, reps - done)
                for _ in range(batch):
                    forward().backward(grad_out)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()  # host time only: the GPU work is not waited for
                for _ in range(batch):
                    drain_one_pass()
                total += time.perf_counter() - start
                if device.type == "cuda":
                    torch.cuda.synchronize()
                done += batch
            return total / (reps * count)

        def drain_ours():
            for layer in reversed(ours):
                layer.backward_dw()

        def drain_python():
            for _ in range(count):
                python_backward_dw()

        dw_ours = time_backward_dw(forward_ours, drain_ours)
        dw_python = time_backward_dw(forward_python, drain_python)
        dw_graphed = graphed_w_seconds(ours, reps) if device.type == "cuda" else float("nan")
        rows.append([count, f"{fwd_ours * 1e6:.1f}", f"{fwd_python * 1e6:.1f}", f"{fwd_plain * 1e6:.1f}",
                     f"{dw_ours * 1e6:.1f}", f"{dw_python * 1e6:.1f}", f"{dw_ours / dw_python:.2f}",
                     f"{dw_graphed * 1e6:.2f}"])
        results["host"].append({"layers": count, "forward_us": {"splitgrad": fwd_ours * 1e6, "python_function": fwd_python * 1e6, "F.linear": fwd_plain * 1e6},
                                "backward_dw_us": {"splitgrad": dw_ours * 1e6, "python_queue": dw_python * 1e6,
                                                   "splitgrad_graphed": dw_graphed * 1e6}})
    columns = ["layers", "fwd µs splitgrad", "fwd µs Python Function module", "fwd µs F.linear", "backward_dw µs splitgrad",
               "W µs Python queue", "W ratio", "W µs graphed"]
    return print_table(f"host overhead per call ({args.device}, 16x16 weights, 4 tokens)", columns, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    results = {"date": datetime.date.today().isoformat(), "device": device_description(), "command": " ".join(sys.argv), "host": []}
    print(f"device: {results['device']}")
    tables = []
    if args.device == "cuda":
        tables.append(bench_mlp(args, results))
    tables.append(bench_host(args, results))
    results["tables"] = tables
    print("results:", write_results(args.out, "bench_step", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
