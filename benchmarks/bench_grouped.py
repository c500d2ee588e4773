"""MoE experts' GEMMs: splitgrad's grouped ops against PyTorch's per-expert loops and grouped GEMM,
side by side in one run, on the shapes and against the targets of issue 13 (bf16, imbalanced
routing).

For each shape (experts, in -> out, tokens), rows are routed to experts by deterministic seeded
imbalanced splits (Zipf-like: a seeded permutation of ranks, expert of rank r getting a share
~ 1/r, one expert getting only ``--align`` tokens; every split a multiple of ``--align``). The
splits used are printed. The contenders:

- **wgrad into an fp32 main_grad** (each expert's main_grad a view of one stacked buffer, as in
  Megatron's grad buffer):
  (a) per-expert in-place ``torch.addmm(main_grad_i, dy_iᵀ, x_i, out_dtype=float32, out=main_grad_i)``;
  (b) ``torch._grouped_mm(dyᵀ, x, offs)`` (bf16 out), then ``main_grad.add_``;
  (c) ``torch._grouped_mm`` alone: the floor of one grouped GEMM, without accumulation;
  (d) ``splitgrad::grouped_linear_wgrad_accumulate_`` with m_splits a device int64 tensor;
  (e) the same with m_splits a CPU tensor.
  Targets: splitgrad <= 0.8x (a) and <= 1.25x (c). Beside them, (f) ``splitgrad::grouped_linear_wgrad``
  (device splits): fresh bf16 gradients, what a parameter without main_grad gets, against (c).
- **fprop and dgrad**: a per-expert loop of ``torch.mm`` into the rows of one output (F.linear /
  matmul without a concatenation), ``torch._grouped_mm``, splitgrad's ``grouped_linear_fprop`` /
  ``grouped_linear_dgrad`` (device and CPU splits). Target: <= 1.02x the faster PyTorch one.
- **bias gradients**: splitgrad's wgrad-accumulate with bias targets vs without them, the bias
  gradients alone (no weight targets), and per-expert ``main_grad_b_i.add_(dy_i.sum(0))``.
  Target: all experts' bias gradients in one pass over dy.
- **host time**: one ``backward_dw()`` of a 32-expert splitgrad.GroupedLinear (tiny shapes; splits
  as a list and as a tensor on the device) against one splitgrad.Linear's, CPU µs per call
  (time.perf_counter around the call, after warmup; the cases interleaved), with the gradients
  going to fp32 main_grads, to a fresh .grad and to an existing one. On a GPU each case is timed
  two ways: right after a synchronisation (the call meets an idle GPU), and right after its
  backward's launches, as a training step calls it (the GPU drained once a round, untimed, so
  the launch queue never fills). On the CPU (``--device cpu``:
  8 -> 8 features, 32 tokens, one thread) the GEMMs run on the host too: the wgrad op is also
  timed alone, and "backward_dw() - op" is the bookkeeping (store, ledger, gradient targets).
  Target: <= 2x.

Device time: the median of CUDA-event timings in interleaved rounds (common.time_side_by_side).
Before timing, each contender runs once from zeroed buffers and its result is compared with an
fp32 per-expert reference ("max rel err": the largest difference over the largest reference value).
``torch._grouped_mm`` needs a CUDA GPU (its fast path sm90, bf16, 16-byte aligned strides): where a
call fails, its columns show "-" and the reason is printed.

    bash scripts/gpu_run.sh python benchmarks/bench_grouped.py --out out        # H200
    python benchmarks/bench_grouped.py --device cpu --tiny --out out              # CPU smoke test
    python benchmarks/bench_grouped.py --device cpu --only host --host-reps 2000   # CPU host time
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import (available, BF16_PEAK_TFLOPS, chosen_by_name, device_description, print_table, tflops,  # noqa: E402
                    time_cpu, time_side_by_side, write_results)

import splitgrad  # noqa: E402  (registers torch.ops.splitgrad)

OPS = torch.ops.splitgrad
SECTIONS = ("wgrad", "fprop_dgrad", "bias", "host")
TARGET_WGRAD_VS_ADDMM = 0.8
TARGET_WGRAD_VS_FLOOR = 1.25
TARGET_FPROP_DGRAD = 1.02
TARGET_HOST = 2.0


@dataclass
class Shape:
    name: str
    experts: int
    fin: int
    fout: int
    tokens: int
    # Issue 13's anchors (H200, PyTorch 2.11 alone), µs: wgrad (a), (b), (c); fprop and dgrad
    # (per-expert loop, grouped_mm).
    anchors: dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.experts} x {self.fin} -> {self.fout}, {self.tokens} tokens"


def _anchors(a, b, c, fprop, dgrad):
    return {"(a) addmm loop": a, "(b) gmm+add_": b, "(c) gmm floor": c, "fprop loop": fprop[0],
            "fprop gmm": fprop[1], "dgrad loop": dgrad[0], "dgrad gmm": dgrad[1]}


SHAPES = [
    Shape("dsv3-gate-up-8", 8, 7168, 4096, 8192, _anchors(1070, 1541, 706, (684, 706), (697, 735))),
    Shape("dsv3-down-8", 8, 2048, 7168, 8192, _anchors(584, 782, 367, (360, 357), (351, 389))),
    Shape("dsv3-gate-up-32", 32, 7168, 4096, 16384, _anchors(3437, 4988, 1656, (1576, 1648), (1760, 1699))),
    Shape("qwen3-30b-a3b-16", 16, 2048, 1536, 16384, _anchors(305, 354, 175, (242, 175), (209, 172))),
    Shape("mixtral-2", 2, 4096, 14336, 8192, _anchors(1488, 1939, 1471, (1340, 1396), (1381, 1323))),
]
TINY_SHAPES = [
    Shape("tiny-8", 8, 32, 16, 256),
    Shape("tiny-2", 2, 16, 48, 64),
    Shape("tiny-32", 32, 16, 24, 1024),
]
# The host-time layers: tiny, so that what is measured is the host's work per backward_dw().
# (features, tokens) per device: on the CPU the GEMMs themselves run on the host, so smaller.
HOST_EXPERTS = 32
HOST_SIZES = {"cuda": (64, 512), "cpu": (8, 32)}
# Where the deferred gradients go: fp32 main_grads (fuse_wgrad_accumulation), a .grad made by the
# call (None before each pass), an existing .grad added to.
HOST_TARGETS = ("main_grad", ".grad fresh", ".grad kept")
HOST_LAYERS = ("Linear", "GroupedLinear, list splits", "GroupedLinear, tensor splits")


def imbalanced_splits(tokens: int, experts: int, seed: int, align: int, exponent: float = 1.0) -> list[int]:
    """Deterministic Zipf-like routing: ``tokens`` rows over ``experts``, every split a multiple
    of ``align`` and at least ``align``; the expert of rank r (a seeded permutation) gets a share
    ~ 1 / r**exponent of the rest, the last-ranked one exactly ``align`` rows (few tokens)."""
    if tokens % align or tokens < experts * align:
        raise ValueError(f"{tokens} tokens cannot be split into {experts} multiples of {align}")
    units = tokens // align
    ranks = torch.randperm(experts, generator=torch.Generator().manual_seed(seed)).tolist()
    weights = [0.0 if r == experts - 1 and experts > 2 else 1.0 / (r + 1) ** exponent for r in ranks]
    spare = units - experts  # one unit each first
    shares = [spare * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    # Largest remainders take the units rounding left over (ties: the lower expert index).
    for i in sorted(range(experts), key=lambda i: (counts[i] - shares[i], i))[: spare - sum(counts)]:
        counts[i] += 1
    splits = [(1 + c) * align for c in counts]
    assert sum(splits) == tokens and min(splits) >= align
    return splits


def grouped_offsets(splits: list[int], device) -> torch.Tensor:
    """torch._grouped_mm's offs: int32 cumulative ends of the groups."""
    return torch.tensor(splits, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def grouped_mm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def addmm_into(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """target += a @ b in place, PyTorch's best: addmm with an fp32 output for lower-precision
    inputs (CUDA only), addmm_ where the dtypes agree."""
    if a.dtype == target.dtype:
        target.addmm_(a, b)
    else:
        torch.addmm(target, a, b, out_dtype=target.dtype, out=target)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.float() - want).abs().max().item() / scale


class Data:
    """One shape's tensors: x [tokens, in], dy [tokens, out], w [experts, out, in] (dtype), fp32
    main_grads [experts, out, in] and [experts, out]; per-expert views of each, and the splits as
    a list, a CPU and a device int64 tensor, and grouped_mm's int32 offsets."""

    def __init__(self, shape: Shape, splits: list[int], device, dtype) -> None:
        self.splits = splits
        self.x = torch.randn(shape.tokens, shape.fin, device=device, dtype=dtype)
        self.dy = torch.randn(shape.tokens, shape.fout, device=device, dtype=dtype)
        self.w = torch.randn(shape.experts, shape.fout, shape.fin, device=device, dtype=dtype) / shape.fin**0.5
        self.main_grad = torch.zeros(shape.experts, shape.fout, shape.fin, device=device)
        self.bias_main_grad = torch.zeros(shape.experts, shape.fout, device=device)
        self.y = torch.empty(shape.tokens, shape.fout, device=device, dtype=dtype)
        self.dx = torch.empty(shape.tokens, shape.fin, device=device, dtype=dtype)
        self.xs, self.dys = self.x.split(splits), self.dy.split(splits)
        self.ys, self.dxs = self.y.split(splits), self.dx.split(splits)
        self.ws = list(self.w.unbind(0))
        self.main_grads = list(self.main_grad.unbind(0))
        self.bias_main_grads = list(self.bias_main_grad.unbind(0))
        self.splits_cpu = torch.tensor(splits, dtype=torch.int64)
        self.splits_device = self.splits_cpu.to(device)
        self.offs = grouped_offsets(splits, device)

    def zero_(self) -> None:
        self.main_grad.zero_()
        self.bias_main_grad.zero_()


def timed(fns, device, min_ms) -> dict[str, float]:
    if not fns:
        return {}
    return time_side_by_side(fns, min_ms=min_ms) if device.type == "cuda" else time_cpu(fns)


def us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def ratio(a: float | None, b: float | None, target: float | None = None) -> str:
    if a is None or b is None:
        return "-"
    text = f"{a / b:.3f}"
    return text if target is None else text + (" ok" if a / b <= target else " MISS")


def wgrad_contenders(d: Data) -> dict[str, Callable[[], object]]:
    def addmm_loop():
        for target, dy, x in zip(d.main_grads, d.dys, d.xs):
            addmm_into(target, dy.t(), x)

    return {
        "(a) addmm loop": addmm_loop,
        "(b) gmm+add_": lambda: d.main_grad.add_(grouped_mm(d.dy.t(), d.x, d.offs)),
        "(c) gmm floor": lambda: grouped_mm(d.dy.t(), d.x, d.offs),
        "(d) splitgrad dev": lambda: OPS.grouped_linear_wgrad_accumulate_(d.dy, d.x, d.splits_device, d.main_grads, []),
        "(e) splitgrad cpu": lambda: OPS.grouped_linear_wgrad_accumulate_(d.dy, d.x, d.splits_cpu, d.main_grads, []),
        "(f) splitgrad fresh": lambda: OPS.grouped_linear_wgrad(d.dy, d.x, d.splits_device, False)[0],
    }


def wgrad_errors(d: Data, fns) -> dict[str, float]:
    """Each contender once from zeroed main_grads against fp32 per-expert dy_iᵀ x_i."""
    want = torch.stack([dy.float().t() @ x.float() for dy, x in zip(d.dys, d.xs)])
    errors = {}
    for name, fn in fns.items():
        d.zero_()
        out = fn()
        if name.startswith("(f)"):  # fresh bf16 gradients, one per expert
            out = torch.stack(out)
        fresh = name.startswith(("(c)", "(f)"))  # a new bf16 result, not main_grad
        errors[name] = relative_error(out if fresh else d.main_grad, want)
    d.zero_()
    return errors


def bench_wgrad(shape: Shape, d: Data, device, args, skipped) -> dict:
    fns = available(wgrad_contenders(d), skipped)
    errors = wgrad_errors(d, fns)
    return {"ms": timed(fns, device, args.min_ms), "max_rel_err": errors}


def fprop_dgrad_contenders(d: Data) -> dict[str, Callable[[], object]]:
    def fprop_loop():
        for x, w, y in zip(d.xs, d.ws, d.ys):
            torch.mm(x, w.t(), out=y)
        return d.y

    def dgrad_loop():
        for dy, w, dx in zip(d.dys, d.ws, d.dxs):
            torch.mm(dy, w, out=dx)
        return d.dx

    return {
        "fprop loop": fprop_loop,
        "fprop gmm": lambda: grouped_mm(d.x, d.w.transpose(-2, -1), d.offs),
        "fprop splitgrad dev": lambda: OPS.grouped_linear_fprop(d.x, d.splits_device, d.ws, []),
        "fprop splitgrad cpu": lambda: OPS.grouped_linear_fprop(d.x, d.splits_cpu, d.ws, []),
        "dgrad loop": dgrad_loop,
        "dgrad gmm": lambda: grouped_mm(d.dy, d.w, d.offs),
        "dgrad splitgrad dev": lambda: OPS.grouped_linear_dgrad(d.dy, d.splits_device, d.ws),
        "dgrad splitgrad cpu": lambda: OPS.grouped_linear_dgrad(d.dy, d.splits_cpu, d.ws),
    }


def bench_fprop_dgrad(shape: Shape, d: Data, device, args, skipped) -> dict:
    fns = available(fprop_dgrad_contenders(d), skipped)
    want_y = torch.cat([x.float() @ w.float().t() for x, w in zip(d.xs, d.ws)])
    want_dx = torch.cat([dy.float() @ w.float() for dy, w in zip(d.dys, d.ws)])
    errors = {name: relative_error(fn(), want_y if name.startswith("fprop") else want_dx) for name, fn in fns.items()}
    return {"ms": timed(fns, device, args.min_ms), "max_rel_err": errors}


def bias_contenders(d: Data) -> dict[str, Callable[[], object]]:
    def addmm_and_sum_loop():
        for target, bias_target, dy, x in zip(d.main_grads, d.bias_main_grads, d.dys, d.xs):
            addmm_into(target, dy.t(), x)
            bias_target.add_(dy.sum(0, dtype=torch.float32))

    def sum_loop():
        for bias_target, dy in zip(d.bias_main_grads, d.dys):
            bias_target.add_(dy.sum(0, dtype=torch.float32))

    wgrad = OPS.grouped_linear_wgrad_accumulate_
    return {
        "splitgrad": lambda: wgrad(d.dy, d.x, d.splits_device, d.main_grads, []),
        "splitgrad+b": lambda: wgrad(d.dy, d.x, d.splits_device, d.main_grads, d.bias_main_grads),
        "splitgrad bias only": lambda: wgrad(d.dy, d.x, d.splits_device, [], d.bias_main_grads),
        "addmm loop": wgrad_contenders(d)["(a) addmm loop"],
        "addmm+sum loop": addmm_and_sum_loop,
        "sum loop": sum_loop,
    }


def bench_bias(shape: Shape, d: Data, device, args, skipped) -> dict:
    fns = available(bias_contenders(d), skipped)
    want = torch.stack([dy.float().sum(0) for dy in d.dys])
    errors = {}
    for name in ("splitgrad+b", "splitgrad bias only", "sum loop"):
        if name in fns:
            d.zero_()
            fns[name]()
            errors[name] = relative_error(d.bias_main_grad, want)
    d.zero_()
    return {"ms": timed(fns, device, args.min_ms), "max_rel_err": errors}


def host_seconds_of_backward_dw(layer, make_pass: Callable[[], None], device, drained: bool = True) -> float:
    """Host seconds of one layer.backward_dw(), after an untimed forward and backward that queue its
    work. ``drained``: on a GPU, a synchronisation between them, so the call meets an idle GPU and
    waits for no earlier work; else the call follows the backward's launches as in training (the
    caller drains the GPU now and then, untimed, so a full launch queue never makes it wait)."""
    make_pass()
    if drained and device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    layer.backward_dw()
    return time.perf_counter() - start


def host_passes(device, dtype, target: str, features: int, tokens: int, splits: list[int]) -> dict:
    """The (layer, make_pass) of each HOST_LAYERS entry for one HOST_TARGETS entry: layers delayed,
    fused into fp32 main_grads for "main_grad", else writing .grad (set to None before every pass
    for ".grad fresh", kept and added to for ".grad kept")."""
    fused = target == "main_grad"
    kw = dict(params_dtype=dtype, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    grouped = splitgrad.GroupedLinear(HOST_EXPERTS, features, features, name=f"bench_grouped_host ({target})", **kw)
    linear = splitgrad.Linear(features, features, name=f"bench_linear_host ({target})", **kw)
    for p in [*grouped.parameters(), *linear.parameters()]:
        if fused:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    splits_tensor = torch.tensor(splits, device=device)
    x = torch.randn(tokens, features, device=device, dtype=dtype)
    dy = torch.randn(tokens, features, device=device, dtype=dtype)

    def make_pass(layer, *splits_arg):
        def run():
            if target == ".grad fresh":
                for p in layer.parameters():
                    p.grad = None
            layer(x, *splits_arg).backward(dy)
        return layer, run

    return dict(zip(HOST_LAYERS, (make_pass(linear), make_pass(grouped, splits), make_pass(grouped, splits_tensor))))


def host_ops_alone(device, dtype, features: int, tokens: int, splits: list[int]) -> dict:
    """The wgrad-accumulate op that backward_dw() runs in the main_grad case, called on its own
    as backward_dw() calls it (same shapes, fp32 main_grad targets, grad mode off, the grouped op
    below autograd), per HOST_LAYERS entry: the rest of backward_dw()'s host time is bookkeeping
    (store, ledger, gradient targets)."""
    x = torch.randn(tokens, features, device=device, dtype=dtype)
    dy = torch.randn(tokens, features, device=device, dtype=dtype)
    main_grad = torch.zeros(HOST_EXPERTS, features, features, device=device)
    bias_main_grad = torch.zeros(HOST_EXPERTS, features, device=device)
    weights, biases = list(main_grad.unbind(0)), list(bias_main_grad.unbind(0))
    splits_cpu = torch.tensor(splits)  # what a list becomes in the forward
    splits_device = splits_cpu.to(device)

    @torch.no_grad()
    def grouped(splits):
        with torch._C._AutoDispatchBelowAutograd():
            OPS.grouped_linear_wgrad_accumulate_(dy, x, splits, weights, biases)

    return dict(zip(HOST_LAYERS, (
        torch.no_grad()(lambda: OPS.linear_wgrad_accumulate_(dy, x, weights[0], biases[0])),
        lambda: grouped(splits_cpu),
        lambda: grouped(splits_device),
    )))


def bench_host(device, dtype, args) -> dict:
    """One backward_dw() of a 32-expert GroupedLinear (splits as a list and as a tensor on the
    device) against one splitgrad.Linear's, for each gradient target (HOST_TARGETS). The calls of
    all cases are interleaved, round after round, so that a busy machine slows them alike. On the
    CPU, one thread (the op's GEMMs then do not hide the host's work behind thread start-ups)."""
    torch.manual_seed(args.seed)
    features = args.host_features or HOST_SIZES[device.type][0]
    tokens = args.host_tokens or HOST_SIZES[device.type][1]
    splits = imbalanced_splits(tokens, HOST_EXPERTS, args.seed, 1, args.zipf)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        cases = {(target, name): case for target in HOST_TARGETS
                 for name, case in host_passes(device, dtype, target, features, tokens, splits).items()}
        ops_alone = host_ops_alone(device, dtype, features, tokens, splits)
        samples: dict = {key: [] for key in [*cases, *ops_alone]}
        in_flight: dict = {key: [] for key in cases}
        for i in range(args.host_warmup + args.host_reps):
            for key, (layer, make_pass) in cases.items():
                seconds = host_seconds_of_backward_dw(layer, make_pass, device, drained=True)
                seconds_in_flight = host_seconds_of_backward_dw(layer, make_pass, device, drained=False)
                if i >= args.host_warmup:
                    samples[key].append(seconds)
                    in_flight[key].append(seconds_in_flight)
            if device.type == "cuda":
                torch.cuda.synchronize()  # untimed: the in-flight calls' queue drained once a round
            for name, op in ops_alone.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                op()
                if i >= args.host_warmup:
                    samples[name].append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.synchronize()
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    if splitgrad.pending_wgrads():
        raise RuntimeError(f"host time: deferred work left: {splitgrad.layers_with_pending_wgrads()}")

    def per_target(stat, taken=samples):
        return {target: {name: stat(taken[target, name]) * 1e6 for name in HOST_LAYERS} for target in HOST_TARGETS}

    return {"device": device.type, "experts": HOST_EXPERTS, "features": features, "tokens": tokens, "splits": splits,
            "reps": args.host_reps, "threads": used_threads, "dtype": str(dtype).removeprefix("torch."),
            "median_us": per_target(statistics.median), "mean_us": per_target(statistics.fmean),
            "in_flight_median_us": per_target(statistics.median, in_flight),
            "op_alone_median_us": {name: statistics.median(samples[name]) * 1e6 for name in HOST_LAYERS}}


def markdown_table(columns: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    """Tables printed as text and kept as markdown."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.markdown: list[str] = []

    def table(self, title: str, columns: list[str], rows: list[list[object]]) -> None:
        if not rows:
            return
        self.text.append(print_table(title, columns, rows))
        self.markdown.append(f"**{title}**\n\n{markdown_table(columns, rows)}")

    def note(self, line: str) -> None:
        tqdm.write(line)  # above a progress bar, if one is showing
        self.text.append(line)
        self.markdown.append(line)


def wgrad_table(report: Report, results: list[dict]) -> None:
    rows, anchor_rows = [], []
    for r in results:
        if "wgrad" not in r:
            continue
        ms, err = r["wgrad"]["ms"], r["wgrad"]["max_rel_err"]
        a, c = ms.get("(a) addmm loop"), ms.get("(c) gmm floor")
        flop = 2.0 * r["tokens"] * r["in"] * r["out"]
        best = min((ms[k] for k in ("(d) splitgrad dev", "(e) splitgrad cpu") if k in ms), default=None)
        rows.append([r["name"], *(us(ms.get(k)) for k in WGRAD_KEYS),
                     "-" if best is None else f"{100 * tflops(flop, best) / BF16_PEAK_TFLOPS:.0f}%",
                     ratio(ms.get("(d) splitgrad dev"), a, TARGET_WGRAD_VS_ADDMM),
                     ratio(ms.get("(d) splitgrad dev"), c, TARGET_WGRAD_VS_FLOOR),
                     ratio(ms.get("(e) splitgrad cpu"), a, TARGET_WGRAD_VS_ADDMM),
                     ratio(ms.get("(e) splitgrad cpu"), c, TARGET_WGRAD_VS_FLOOR),
                     ratio(ms.get("(b) gmm+add_"), a),
                     ratio(ms.get("(f) splitgrad fresh"), c),
                     f"{max(err.values()):.1e}" if err else "-"])
        if r["anchors"]:
            anchor_rows.append([r["name"], *(f"{us(ms.get(k))} / {r['anchors'][k]}" for k in WGRAD_KEYS[:3])])
    report.table(
        "wgrad into fp32 main_grad, µs: (a) per-expert addmm, (b) grouped_mm + add_, (c) grouped_mm alone "
        f"(floor), splitgrad (d) device / (e) CPU splits; targets <= {TARGET_WGRAD_VS_ADDMM} x (a), "
        f"<= {TARGET_WGRAD_VS_FLOOR} x (c); (f) splitgrad into fresh bf16 gradients",
        ["shape", *WGRAD_KEYS, "splitgrad % peak", "(d)/(a)", "(d)/(c)", "(e)/(a)", "(e)/(c)", "(b)/(a)",
         "(f)/(c)", "max rel err"], rows)
    report.table("PyTorch's wgrad contenders in this run against issue 13's anchors (µs, this run / anchor)",
                 ["shape", *WGRAD_KEYS[:3]], anchor_rows)


WGRAD_KEYS = ["(a) addmm loop", "(b) gmm+add_", "(c) gmm floor", "(d) splitgrad dev", "(e) splitgrad cpu",
              "(f) splitgrad fresh"]


def fprop_dgrad_table(report: Report, results: list[dict]) -> None:
    rows = []
    for r in results:
        if "fprop_dgrad" not in r:
            continue
        ms, err = r["fprop_dgrad"]["ms"], r["fprop_dgrad"]["max_rel_err"]
        for op in ("fprop", "dgrad"):
            torch_best = min((ms[k] for k in (f"{op} loop", f"{op} gmm") if k in ms), default=None)
            anchors = r["anchors"]
            rows.append([r["name"], op, us(ms.get(f"{op} loop")), us(ms.get(f"{op} gmm")),
                         us(ms.get(f"{op} splitgrad dev")), us(ms.get(f"{op} splitgrad cpu")),
                         ratio(ms.get(f"{op} splitgrad dev"), torch_best, TARGET_FPROP_DGRAD),
                         ratio(ms.get(f"{op} splitgrad cpu"), torch_best, TARGET_FPROP_DGRAD),
                         f"{anchors[op + ' loop']} / {anchors[op + ' gmm']}" if anchors else "-",
                         f"{max((v for k, v in err.items() if k.startswith(op)), default=float('nan')):.1e}"])
    report.table(f"fprop and dgrad, µs: per-expert mm loop, grouped_mm, splitgrad (device / CPU splits); target "
                 f"<= {TARGET_FPROP_DGRAD} x the faster PyTorch one",
                 ["shape", "op", "loop", "grouped_mm", "splitgrad dev", "splitgrad cpu", "dev / best", "cpu / best",
                  "anchors loop / gmm", "max rel err"], rows)


def bias_table(report: Report, results: list[dict]) -> None:
    rows = []
    for r in results:
        if "bias" not in r:
            continue
        ms, err = r["bias"]["ms"], r["bias"]["max_rel_err"]
        only = ms.get("splitgrad bias only")
        dy_bytes = r["tokens"] * r["out"] * r["dy_element_size"]
        extra = (f"{100 * (ms['splitgrad+b'] / ms['splitgrad'] - 1):+.1f}%"
                 if "splitgrad+b" in ms and "splitgrad" in ms else "-")
        extra_torch = (f"{100 * (ms['addmm+sum loop'] / ms['addmm loop'] - 1):+.1f}%"
                       if "addmm+sum loop" in ms and "addmm loop" in ms else "-")
        rows.append([r["name"], us(ms.get("splitgrad")), us(ms.get("splitgrad+b")), extra, us(only),
                     "-" if only is None else f"{dy_bytes / (only * 1e-3) / 1e9:.0f}", us(ms.get("sum loop")),
                     ratio(only, ms.get("sum loop")), extra_torch,
                     f"{max(err.values()):.1e}" if err else "-"])
    report.table("bias gradients, µs: splitgrad wgrad-accumulate without / with bias targets, the bias gradients "
                 "alone (GB/s: dy read once), per-expert dy_i.sum(0) + add_",
                 ["shape", "splitgrad", "splitgrad+b", "bias costs", "bias only", "GB/s", "sum loop",
                  "bias only / sum loop", "addmm loop: bias costs", "max rel err"], rows)


def host_table(report: Report, host: dict) -> None:
    def ratio_rows(median: dict) -> list[list[object]]:
        return [[target, *(f"{median[target][name]:.1f}" for name in HOST_LAYERS),
                 *(ratio(median[target][name], median[target]["Linear"], TARGET_HOST) for name in HOST_LAYERS[1:])]
                for target in HOST_TARGETS]

    median = host["median_us"]
    rows = ratio_rows(median)
    op = host["op_alone_median_us"]
    rest = {name: median["main_grad"][name] - op[name] for name in HOST_LAYERS}
    # The op alone is called through torch.ops from Python, which costs a few µs more than the
    # bound backward_dw() call: the difference is the bookkeeping less that constant.
    rows += [["main_grad: the op alone", *(f"{op[name]:.1f}" for name in HOST_LAYERS), "", ""],
             ["main_grad: backward_dw() - op", *(f"{rest[name]:.1f}" for name in HOST_LAYERS), "", ""]]
    columns = ["gradient target", "Linear", "grouped, list splits", "grouped, tensor splits", "list / Linear",
               "tensor / Linear"]
    layers = (f"GroupedLinear {host['experts']} experts, {host['features']} -> {host['features']}, "
              f"{host['tokens']} tokens, {host['dtype']}; target <= {TARGET_HOST} x Linear's")
    after_sync = ", each call after a synchronisation" if host["device"] == "cuda" else ""
    report.table(f"host time of one backward_dw(), µs per call (median of {host['reps']}, {host['threads']} "
                 f"thread(s)){after_sync}; {layers}", columns, rows)
    if host["device"] == "cuda" and "in_flight_median_us" in host:
        report.table(f"host time of one backward_dw(), µs per call (median of {host['reps']}), each call right "
                     f"after its backward's launches, as in training (GPU drained once a round, untimed); {layers}",
                     columns, ratio_rows(host["in_flight_median_us"]))


def grouped_mm_note(device, dtype) -> str | None:
    """Why grouped_mm's numbers may not be PyTorch's fast path here, if they may not."""
    if device.type != "cuda":
        return "grouped_mm: on the CPU PyTorch runs a reference loop (not a grouped GEMM)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0) or dtype != torch.bfloat16:
        return f"grouped_mm: its fast path needs sm90+ and bf16 (here sm_{major}{minor}, {dtype}): a fallback runs"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on cuda, float32 on cpu (PyTorch's CPU addmm has no fp32 output "
                             "for bf16 inputs)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test, e.g. on the CPU)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all of the chosen size)")
    parser.add_argument("--only", choices=SECTIONS, nargs="*", help="sections to run (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the routing's (and the data's) seed")
    parser.add_argument("--zipf", type=float, default=1.0, help="the routing's Zipf exponent (0: balanced but one)")
    parser.add_argument("--align", type=int, default=16, help="every split a multiple of this many tokens")
    parser.add_argument("--min-ms", type=float, default=60.0, help="device time per contender to time, at least")
    parser.add_argument("--host-reps", type=int, default=200, help="backward_dw() calls timed per layer")
    parser.add_argument("--host-warmup", type=int, default=20)
    parser.add_argument("--host-features", type=int, default=None,
                        help=f"host-time layers' in and out features (default: {HOST_SIZES})")
    parser.add_argument("--host-tokens", type=int, default=None, help="host-time tokens (default: as above)")
    parser.add_argument("--out", default=None, help="folder for bench_grouped.json and bench_grouped.md")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (use --device cpu --tiny for a smoke test)")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    shapes = chosen_by_name(parser, "--shapes", shapes, args.shapes)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    wanted = args.only or list(SECTIONS)
    device_name = device_description() if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    report = Report()
    report.note(f"device: {device_name}; {dtype}; routing: seed {args.seed}, Zipf exponent "
                f"{args.zipf}, splits multiples of {args.align}")
    if note := grouped_mm_note(device, dtype):
        report.note(note)

    results, skipped = [], {}
    benches = [("wgrad", bench_wgrad), ("fprop_dgrad", bench_fprop_dgrad), ("bias", bench_bias)]
    for shape in tqdm(shapes if any(s != "host" for s in wanted) else [], desc="shapes", unit="shape",
                      disable=args.quiet):
        splits = imbalanced_splits(shape.tokens, shape.experts, args.seed, args.align, args.zipf)
        report.note(f"{shape.name} ({shape.describe()}): splits {splits}")
        torch.manual_seed(args.seed)
        d = Data(shape, splits, device, dtype)
        result = {"name": shape.name, "experts": shape.experts, "in": shape.fin, "out": shape.fout,
                  "tokens": shape.tokens, "splits": splits, "anchors": shape.anchors,
                  "dy_element_size": d.dy.element_size()}
        for section, bench in benches:
            if section in wanted:
                shape_skipped = {}
                result[section] = bench(shape, d, device, args, shape_skipped)
                for name, reason in shape_skipped.items():
                    skipped.setdefault(f"{section}: {name}: {reason}", []).append(shape.name)
        results.append(result)
        del d
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for what, names in skipped.items():
        report.note(f"skipped {what} (shapes: {', '.join(names)})")
    wgrad_table(report, results)
    fprop_dgrad_table(report, results)
    bias_table(report, results)
    host = bench_host(device, dtype, args) if "host" in wanted else None
    if host:
        report.note(f"host-time splits: {host['splits']}")
        host_table(report, host)
    elapsed = time.perf_counter() - started
    print(f"{len(results)} shapes in {elapsed:.1f} s on {device_name}")
    if args.out:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        command = "python benchmarks/bench_grouped.py " + " ".join(argv if argv is not None else sys.argv[1:])
        payload = {"date": date, "device": device_name, "dtype": str(dtype).removeprefix("torch."),
                   "torch": torch.__version__, "command": command, "seconds": elapsed, "seed": args.seed,
                   "zipf": args.zipf, "align": args.align, "shapes": results, "host": host,
                   "skipped": {what: names for what, names in skipped.items()}, "tables": report.text}
        path = write_results(args.out, "bench_grouped", payload)
        markdown = f"{args.out}/bench_grouped.md"
        with open(markdown, "w") as f:
            f.write(f"`{command}`, {date}, {device_name}\n\n" + "\n\n".join(report.markdown) + "\n")
        print(f"results: {path}, {markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
