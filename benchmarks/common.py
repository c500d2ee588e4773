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


def time_cuda(fn: Callable[[], object], warmup: int = 3, min_ms: float = 60.0, max_reps: int = 200) -> float:
    """Median milliseconds of fn() over repetitions timed with CUDA events (after a warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(5, min_ms / estimate)))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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
