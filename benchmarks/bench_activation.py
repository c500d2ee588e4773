"""LayerNormMLP's gated activations: splitgrad's fused CUDA kernels (``splitgrad::activation`` and
``activation_backward``, src/cuda/activation_cuda.cu) against the ATen composite they replace, side
by side in one run (issue 14; H200, bf16).

For each shape (tokens x 2·ffn input) and gated activation (TE's names), the contenders:

- **forward**: PyTorch's ``act(a) * b`` on the input's halves (two kernels, act(a) materialised)
  against ``splitgrad::activation`` (one pass: reads the input once, writes y once);
- **backward**: torch.autograd's gradient of that composite (``torch.autograd.grad`` with the graph
  kept: mul, the activation's backward, mul, cat) against ``splitgrad::activation_backward`` (one
  pass: reads grad and the input once, writes d input once).

GB/s counts each contender's minimum traffic: forward input + output, backward grad + input + d input.
Before timing, each result is compared with the composite's: "equal" is torch.equal (the fused
kernels are built to match bit for bit), else the largest difference is shown. Device time: the
median of CUDA-event timings in interleaved rounds (common.time_side_by_side). On the CPU the
splitgrad ops run their ATen path (a smoke test of this script).

    bash scripts/gpu_run.sh python benchmarks/bench_activation.py --out out      # H200
    python benchmarks/bench_activation.py --device cpu --tiny --out out            # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import (available, chosen_by_name, device_description, print_table, time_cpu,  # noqa: E402
                    time_side_by_side, write_results)

import splitgrad  # noqa: E402,F401  (registers torch.ops.splitgrad)

OPS = torch.ops.splitgrad
GATED = {"swiglu": torch.nn.functional.silu, "geglu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
         "reglu": torch.relu}
CONTENDERS = ("fwd torch", "fwd splitgrad", "bwd torch", "bwd splitgrad")


@dataclass
class Shape:
    name: str
    tokens: int
    ffn: int  # the activation's output width; its input is 2 * ffn wide

    def describe(self) -> str:
        return f"{self.tokens} x 2·{self.ffn}"


SHAPES = [Shape("llama-70b-ffn", 16384, 14336), Shape("ffn-4096", 4096, 4096)]
TINY_SHAPES = [Shape("tiny", 64, 24), Shape("tiny-odd", 7, 5)]


def composite(name: str, x: torch.Tensor) -> torch.Tensor:
    """PyTorch's gated activation: act(a) * b on the last dim's halves."""
    a, b = x.chunk(2, dim=-1)
    return GATED[name](a) * b


def contenders(name: str, x: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    leaf = x.detach().requires_grad_(True)
    y = composite(name, leaf)  # the graph autograd's backward runs on, kept for every call
    return {
        "fwd torch": lambda: composite(name, x),
        "fwd splitgrad": lambda: OPS.activation(x, name),
        "bwd torch": lambda: torch.autograd.grad(y, leaf, grad, retain_graph=True)[0],
        "bwd splitgrad": lambda: OPS.activation_backward(grad, x, name),
    }


def agreement(got: torch.Tensor, want: torch.Tensor) -> str:
    """'equal' (torch.equal), else the largest absolute difference."""
    if torch.equal(got, want):
        return "equal"
    return f"max diff {(got.double() - want.double()).abs().max().item():.2e}"


def bench_one(shape: Shape, name: str, device, dtype, args, skipped: dict[str, str]) -> dict:
    x = torch.randn(shape.tokens, 2 * shape.ffn, device=device, dtype=dtype)
    grad = torch.randn(shape.tokens, shape.ffn, device=device, dtype=dtype)
    fns = available(contenders(name, x, grad), skipped)
    checks = {}
    for op in ("fwd", "bwd"):
        if f"{op} torch" in fns and f"{op} splitgrad" in fns:
            checks[op] = agreement(fns[f"{op} splitgrad"](), fns[f"{op} torch"]())
    ms = (time_side_by_side(fns, min_ms=args.min_ms) if device.type == "cuda" else time_cpu(fns)) if fns else {}
    element = x.element_size()
    rows_n = shape.tokens * shape.ffn
    return {"shape": shape.name, "tokens": shape.tokens, "ffn": shape.ffn, "activation": name, "ms": ms,
            "bytes": {"fwd": 3 * rows_n * element, "bwd": 5 * rows_n * element}, "checks": checks}


def us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def gbps(nbytes: int, ms: float | None) -> str:
    return "-" if ms is None else f"{nbytes / (ms * 1e-3) / 1e9:.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def markdown_table(columns: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def table(results: list[dict], dtype) -> tuple[str, list[str], list[list[object]]]:
    columns = ["shape", "activation", "op", "torch µs", "splitgrad µs", "torch GB/s", "splitgrad GB/s",
               "splitgrad / torch", "result"]
    rows = []
    for r in results:
        for op in ("fwd", "bwd"):
            t, s = r["ms"].get(f"{op} torch"), r["ms"].get(f"{op} splitgrad")
            rows.append([f"{r['shape']} ({r['tokens']} x 2·{r['ffn']})", r["activation"], op, us(t), us(s),
                         gbps(r["bytes"][op], t), gbps(r["bytes"][op], s), ratio(s, t),
                         r["checks"].get(op, "-")])
    title = (f"gated activations, {str(dtype).removeprefix('torch.')}: PyTorch's composite (act(a) * b; autograd's "
             "backward) vs splitgrad's fused kernels; GB/s at the minimum traffic")
    return title, columns, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test, e.g. on the CPU)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all of the chosen size)")
    parser.add_argument("--activations", default=",".join(GATED), help="comma-separated gated activations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-ms", type=float, default=60.0, help="device time per contender to time, at least")
    parser.add_argument("--out", default=None, help="folder for bench_activation.json and bench_activation.md")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (use --device cpu --tiny for a smoke test)")
    shapes = chosen_by_name(parser, "--shapes", TINY_SHAPES if args.tiny else SHAPES, args.shapes)
    names = args.activations.split(",")
    if unknown := [n for n in names if n not in GATED]:
        parser.error(f"--activations: unknown {unknown} (choose from {sorted(GATED)})")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    device_name = device_description() if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    print(f"device: {device_name}; {dtype}", flush=True)

    results, skipped = [], {}
    cases = [(shape, name) for shape in shapes for name in names]
    for shape, name in tqdm(cases, desc="cases", unit="case", disable=args.quiet):
        torch.manual_seed(args.seed)
        case_skipped = {}
        results.append(bench_one(shape, name, device, dtype, args, case_skipped))
        for contender, reason in case_skipped.items():
            skipped.setdefault(f"{contender}: {reason}", []).append(f"{shape.name} {name}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = [f"skipped {what} ({', '.join(cases_)})" for what, cases_ in skipped.items()]
    for line in notes:
        print(line)
    title, columns, rows = table(results, dtype)
    text = print_table(title, columns, rows)
    elapsed = time.perf_counter() - started
    print(f"{len(results)} cases in {elapsed:.1f} s on {device_name}")
    if args.out:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        command = "python benchmarks/bench_activation.py " + " ".join(argv if argv is not None else sys.argv[1:])
        payload = {"date": date, "device": device_name, "dtype": str(dtype).removeprefix("torch."),
                   "torch": torch.__version__, "command": command, "seconds": elapsed, "seed": args.seed,
                   "results": results, "skipped": skipped, "tables": [*notes, text]}
        path = write_results(args.out, "bench_activation", payload)
        markdown = f"{args.out}/bench_activation.md"
        with open(markdown, "w") as f:
            f.write(f"`{command}`, {date}, {device_name}\n\n" + "\n\n".join(notes + [f"**{title}**",
                                                                                 markdown_table(columns, rows)]) + "\n")
        print(f"results: {path}, {markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
