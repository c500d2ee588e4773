"""Where the host time of a GroupedLinear's backward_dw() goes, against a splitgrad.Linear's.

    bash scripts/gpu_run.sh python benchmarks/profile_grouped_host.py [--experts 32] [--calls 200]

Times one backward_dw() after an untimed forward and backward (as bench_grouped.py's host section
does, the cases interleaved), then profiles the same calls with torch.profiler (CPU ops and CUDA
runtime calls) and prints each case's top entries by self CPU time per call: the launches,
allocations and checks that make up the difference.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import splitgrad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kw = dict(params_dtype=dtype, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    grouped = splitgrad.GroupedLinear(args.experts, args.features, args.features, **kw)
    linear = splitgrad.Linear(args.features, args.features, **kw)
    for p in [*grouped.parameters(), *linear.parameters()]:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    base, extra = divmod(args.tokens, args.experts)
    splits = [base + (1 if e < extra else 0) for e in range(args.experts)]
    x = torch.randn(args.tokens, args.features, device=device, dtype=dtype)
    dy = torch.randn(args.tokens, args.features, device=device, dtype=dtype)
    cases = {"Linear": (linear, ()), "Grouped, list": (grouped, (splits,)),
             "Grouped, tensor": (grouped, (torch.tensor(splits, device=device),))}

    def one(layer, extra_args) -> float:
        layer(x, *extra_args).backward(dy)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer.backward_dw()
        return time.perf_counter() - start

    samples = {name: [] for name in cases}
    for i in range(20 + args.calls):
        for name, (layer, extra_args) in cases.items():
            seconds = one(layer, extra_args)
            if i >= 20:
                samples[name].append(seconds)
    medians = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
    for name, us in medians.items():
        print(f"{name:18s} {us:8.1f} us per backward_dw()  ({us / medians['Linear']:.2f}x Linear)")

    for name, (layer, extra_args) in cases.items():
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(args.calls):
                layer(x, *extra_args).backward(dy)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                with torch.profiler.record_function("backward_dw"):
                    layer.backward_dw()
        inside = {}  # only what ran inside backward_dw(): its descendants

        def within(event) -> bool:
            parent = event
            while parent is not None:
                if parent.name == "backward_dw":
                    return True
                parent = parent.cpu_parent
            return False

        total_self = 0.0
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CPU or not within(e):
                continue
            entry = inside.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.self_cpu_time_total
            total_self += e.self_cpu_time_total
        print(f"\n{name}: self CPU time inside backward_dw(), per call (profiled: {total_self / args.calls:.1f} us)")
        for op, (count, self_us) in sorted(inside.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {self_us / args.calls:8.2f} us  {count / args.calls:6.2f} calls  {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
