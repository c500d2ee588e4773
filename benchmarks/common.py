"""Shared benchmark helpers: CUDA-event timing, FLOP rates, tables, result files."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

import torch

# Dense bf16 tensor-core peak of an H100/H200 SXM (datasheet); ratios are the point, this is scale.
BF16_PEAK_TFLOPS = 989.0


_SLEEP_CYCLES_PER_MS: float | None = None


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep (measured once)."""
    global _SLEEP_CYCLES_PER_MS
    if _SLEEP_CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    return _SLEEP_CYCLES_PER_MS


def time_side_by_side(fns: dict[str, Callable[[], object]], warmup: int = 3, min_ms: float = 60.0,
                      max_reps: int = 200) -> dict[str, float]:
    """Median device milliseconds of each fn(), timed with CUDA events in interleaved rounds.

    Device time, not host time: before each timed call the GPU is kept busy by a sleep kernel
    longer than the call's host work, so the start event, the call's kernels and the end event
    are all queued before the GPU reaches them (launch latency and Python overhead, which host
    benchmarks measure, stay out). Rounds run every contender once, in a rotating order, so clock
    and thermal drift touch all of them alike and the ratios of one run are comparable.
    """
    names = list(fns)
    host_ms = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        torch.cuda.synchronize()
        began = time.perf_counter()
        fns[name]()
        host_ms[name] = (time.perf_counter() - began) * 1e3
        torch.cuda.synchronize()
    cycles_per_ms = _sleep_cycles_per_ms()

    def timed_round(order):
        events = []
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(cycles_per_ms * (2.0 * host_ms[name] + 0.05)))
            start.record()
            fns[name]()
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        return {name: start.elapsed_time(end) for name, start, end in events}

    estimate = timed_round(names)
    reps = int(min(max_reps, max(5, min_ms / max(max(estimate.values()), 1e-3))))
    samples = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name, ms in timed_round(names[shift:] + names[:shift]).items():
            samples[name].append(ms)
    return {name: statistics.median(values) for name, values in samples.items()}


def time_cpu(fns: dict[str, Callable[[], object]], warmup: int = 1, reps: int = 5) -> dict[str, float]:
    """Median milliseconds of each fn() on the CPU (perf_counter), in interleaved rounds."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def chosen_by_name(parser, flag: str, items: list, names: str | None) -> list:
    """The items (each with a ``.name``) named in the comma-separated ``names`` (all when None); an
    unknown name is a parser error naming ``flag`` and the known names."""
    if not names:
        return items
    known = {item.name: item for item in items}
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
        parser.error(f"{flag}: unknown {unknown} (choose from {sorted(known)})")
    return [known[n] for n in names.split(",")]


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Bytes allocated above the starting level at the peak of one fn() call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def host_seconds(fn: Callable[[], object], reps: int) -> float:
    """CPU wall time per call of fn() (the host overhead; device work is not waited for)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def available(fns: dict[str, Callable[[], object]], skipped: dict[str, str]) -> dict[str, Callable[[], object]]:
    """The contenders whose first call works; the others' reasons go into ``skipped``."""
    kept = {}
    for name, fn in fns.items():
        try:
            fn()
            kept[name] = fn
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
            skipped[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return kept


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> str:
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    lines = [title, " | ".join(str(c).rjust(w) for c, w in zip(columns, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def device_description() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, CUDA {torch.version.cuda}"


def write_results(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def cuda_kernels_of(fn: Callable[[], object]) -> list[tuple[str, float]]:
    """(name, µs) of each CUDA kernel one call of ``fn`` launches, in launch order (torch.profiler,
    after three warm calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time_total) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]
