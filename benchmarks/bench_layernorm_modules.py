"""A training step of splitgrad.LayerNormMLP and splitgrad.LayerNormLinear, side by side in one run
with the same block in plain PyTorch and the same block built from splitgrad.Linear's.

The step, for every variant: forward, backward of a fixed output gradient (the input requires grad,
as inside a network), the deferred wgrad (``backward_dw()``), and every gradient accumulated in an
fp32 ``main_grad`` (Megatron's mixed precision). The variants, built with the same weights:

- **splitgrad**: the module with ``delay_wgrad_compute=True, fuse_wgrad_accumulation=True`` (its
  GEMMs add into ``main_grad``; the norm's ``.grad`` is added by a post-accumulate-grad hook, as TE's
  norm gradients are in Megatron).
- **plain**: ``nn.LayerNorm`` / ``nn.RMSNorm``, ``nn.Linear``, the activation; every parameter's
  ``.grad`` added to ``main_grad`` by a post-accumulate-grad hook (``main_grad.add_(grad)``, as
  Megatron does) and dropped.
- **Linear-built**: the same norm, ``splitgrad.Linear(delay_wgrad_compute=True,
  fuse_wgrad_accumulation=True)`` for each GEMM, the activation; the norm's ``.grad`` by the hook.
- **immediate**: the splitgrad module with ``delay_wgrad_compute=False`` (wgrad inside the backward,
  fused): what deferring costs in memory is the difference to **splitgrad** (a deferred wgrad holds
  each GEMM's input and grad-output until ``backward_dw()``, where the immediate one frees them
  during the backward).

Time: the median device time of a step with CUDA events, the variants in interleaved rounds
(benchmarks/common.py: time_side_by_side). Memory: ``torch.cuda.max_memory_allocated`` during a step
above what is allocated before it (parameters, ``main_grad``s, the input and the output gradient).
Before timing, one step of each variant from zeroed ``main_grad``s is compared with plain's (the
largest difference relative to the largest gradient).

    bash scripts/gpu_run.sh python benchmarks/bench_layernorm_modules.py --out out   # H200: < 90 s
    python benchmarks/bench_layernorm_modules.py --device cpu --tiny --out out         # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import (chosen_by_name, device_description, peak_memory_bytes, print_table, time_cpu,  # noqa: E402
                    time_side_by_side, write_results)

import splitgrad  # noqa: E402

VARIANTS = ("splitgrad", "plain", "Linear-built", "immediate")


@dataclass
class Case:
    """One block to measure: ``module`` "mlp" (LayerNormMLP) or "linear" (LayerNormLinear)."""

    name: str
    module: str
    hidden: int
    out: int  # LayerNormMLP: ffn_hidden_size; LayerNormLinear: out_features
    tokens: int
    normalization: str
    activation: str = "gelu"

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu", "reglu")

    def flop(self) -> float:
        """Forward, dgrad and wgrad of the GEMMs: 3 x 2·tokens·in·out each."""
        if self.module == "linear":
            shapes = [(self.hidden, self.out)]
        else:
            shapes = [(self.hidden, (2 if self.gated else 1) * self.out), (self.out, self.hidden)]
        return sum(3 * 2.0 * self.tokens * i * o for i, o in shapes)

    def describe(self) -> str:
        if self.module == "linear":
            return f"LayerNormLinear {self.hidden} -> {self.out}, {self.normalization}, {self.tokens} tokens"
        return (f"LayerNormMLP {self.hidden} / ffn {self.out}, {self.normalization}, {self.activation}, "
                f"{self.tokens} tokens")


# The H200 shapes: Llama-3-8B's MLP (RMSNorm, SwiGLU), a GPT-2-medium-sized MLP (LayerNorm, GELU),
# and a 4096-wide attention's QKV projection.
CASES = [
    Case("mlp-4096", "mlp", 4096, 14336, 16384, "RMSNorm", "swiglu"),
    Case("mlp-1024", "mlp", 1024, 4096, 4096, "LayerNorm", "gelu"),
    Case("qkv-4096", "linear", 4096, 3 * 4096, 16384, "LayerNorm"),
]
TINY_CASES = [
    Case("mlp-tiny", "mlp", 64, 192, 128, "RMSNorm", "swiglu"),
    Case("mlp-tiny-gelu", "mlp", 32, 128, 64, "LayerNorm", "gelu"),
    Case("qkv-tiny", "linear", 64, 3 * 64, 128, "LayerNorm"),
]


def plain_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """TE's activations in plain PyTorch: "gelu" is the tanh approximation; a gated one computes
    act(a) * b for x = [a | b]."""
    act = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "silu": F.silu,
           "geglu": lambda t: F.gelu(t, approximate="tanh"), "reglu": F.relu, "swiglu": F.silu}[name]
    if name in ("swiglu", "geglu", "reglu"):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b
    return act(x)


class NormGemms(nn.Module):
    """The block from separate pieces: ``norm``, ``fc1`` (and the activation and ``fc2`` for an MLP)."""

    def __init__(self, norm: nn.Module, fc1: nn.Module, fc2: nn.Module | None, activation: str) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2, self.activation = norm, fc1, fc2, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        if self.fc2 is None:
            return h
        return self.fc2(plain_activation(self.activation, h))


@dataclass
class Variant:
    module: nn.Module
    delayed: list = field(default_factory=list)  # modules whose backward_dw() runs, in this order
    fused: list = field(default_factory=list)  # splitgrad modules whose GEMMs add into main_grad


def build_variants(case: Case, device: torch.device, dtype: torch.dtype) -> dict[str, Variant]:
    """The variants of ``case`` with the same weights (the splitgrad module's), every parameter with
    an fp32 ``main_grad``."""
    fused = dict(params_dtype=dtype, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)

    def module(**kw):
        if case.module == "mlp":
            return splitgrad.LayerNormMLP(case.hidden, case.out, normalization=case.normalization,
                                          activation=case.activation, **{**fused, **kw})
        return splitgrad.LayerNormLinear(case.hidden, case.out, normalization=case.normalization, **{**fused, **kw})

    ours = module()
    if case.module == "mlp":
        fc1_out = ours.fc1_weight.shape[0]
        gemms = [("fc1_weight", "fc1_bias", case.hidden, fc1_out), ("fc2_weight", "fc2_bias", case.out, case.hidden)]
    else:
        gemms = [("weight", "bias", case.hidden, case.out)]

    def norm():
        cls = nn.LayerNorm if case.normalization == "LayerNorm" else nn.RMSNorm
        layer = cls(case.hidden, eps=ours.eps, device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(ours.layer_norm_weight)
            if ours.layer_norm_bias is not None:
                layer.bias.copy_(ours.layer_norm_bias)
        return layer

    def gemm(make, w, b):
        layer = make()
        with torch.no_grad():
            layer.weight.copy_(getattr(ours, w))
            layer.bias.copy_(getattr(ours, b))
        return layer

    def pieces(linear):
        layers = [gemm(lambda: linear(i, o), w, b) for w, b, i, o in gemms]
        return NormGemms(norm(), layers[0], layers[1] if len(layers) > 1 else None, case.activation)

    plain = pieces(lambda i, o: nn.Linear(i, o, device=device, dtype=dtype))
    built = pieces(lambda i, o: splitgrad.Linear(i, o, **fused))
    built_gemms = [m for m in (built.fc2, built.fc1) if m is not None]
    immediate = module(delay_wgrad_compute=False)
    with torch.no_grad():
        for a, b in zip(immediate.parameters(), ours.parameters(), strict=True):
            a.copy_(b)
    variants = {
        "splitgrad": Variant(ours, [ours], [ours]),
        "plain": Variant(plain),
        "Linear-built": Variant(built, built_gemms, built_gemms),
        "immediate": Variant(immediate, [], [immediate]),
    }
    for variant in variants.values():
        gemm_fused = {id(p) for m in variant.fused for n, p in m.named_parameters(recurse=False)
                      if not n.startswith("layer_norm_")}
        for p in variant.module.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
            if id(p) not in gemm_fused:
                p.register_post_accumulate_grad_hook(fold_into_main_grad)
    return variants


def fold_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def train_step(variant: Variant, x: torch.Tensor, dy: torch.Tensor) -> None:
    x.grad = None
    variant.module(x).backward(dy)
    for layer in variant.delayed:
        layer.backward_dw()


def gradient_differences(variants: dict[str, Variant], x, dy) -> dict[str, float]:
    """One step of each variant from zeroed main_grads: the largest difference of its main_grads and
    input gradient from plain's, relative to the largest of plain's."""
    grads = {}
    for name, variant in variants.items():
        for p in variant.module.parameters():
            p.main_grad.zero_()
        train_step(variant, x, dy)
        grads[name] = [p.main_grad.clone() for p in variant.module.parameters()] + [x.grad.float()]
    scale = max(g.abs().max().item() for g in grads["plain"]) or 1.0
    return {name: max((a - b).abs().max().item() for a, b in zip(grads[name], grads["plain"])) / scale
            for name in variants}


def bench_case(case: Case, device: torch.device, dtype: torch.dtype, min_ms: float) -> dict:
    torch.manual_seed(0)
    variants = build_variants(case, device, dtype)
    x = torch.randn(case.tokens, case.hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(case.tokens, case.hidden if case.module == "mlp" else case.out, device=device, dtype=dtype)
    differences = gradient_differences(variants, x, dy)
    steps = {name: (lambda v=v: train_step(v, x, dy)) for name, v in variants.items()}
    if device.type == "cuda":
        ms = time_side_by_side(steps, min_ms=min_ms)
        peak = {}
        for name, step in steps.items():
            x.grad = None  # the step's own input gradient counts in its peak
            peak[name] = peak_memory_bytes(step)
    else:
        ms, peak = time_cpu(steps), {name: None for name in steps}
    if splitgrad.pending_wgrads():
        raise RuntimeError(f"{case.name}: deferred work left: {splitgrad.layers_with_pending_wgrads()}")
    del variants, steps, x, dy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {**case.__dict__, "description": case.describe(), "flop": case.flop(), "ms": ms, "peak_bytes": peak,
            "relative_gradient_difference": differences}


def table(results: list[dict], dtype_name: str) -> str:
    rows = []
    for r in results:
        for name in VARIANTS:
            ms, peak = r["ms"][name], r["peak_bytes"][name]
            base_peak = r["peak_bytes"]["plain"]
            rows.append([r["name"], name, f"{ms:.3f}", f"{r['flop'] / (ms * 1e-3) / 1e12:.3g}",
                         f"{ms / r['ms']['plain']:.3f}", f"{ms / r['ms']['Linear-built']:.3f}",
                         "-" if peak is None else f"{peak / 2**30:.3f}",
                         "-" if peak is None or not base_peak else f"{peak / base_peak:.3f}",
                         f"{r['relative_gradient_difference'][name]:.1e}"])
    title = (f"Training step (forward, backward, backward_dw, fp32 main_grad), {dtype_name}: "
             "median of interleaved rounds; peak above parameters, main_grads, input and output gradient")
    text = print_table(title, ["case", "variant", "ms", "TFLOP/s", "vs plain", "vs Linear-built", "peak GiB",
                               "peak vs plain", "grad diff vs plain"], rows)
    legend = "\n".join(f"{r['name']}: {r['description']}" for r in results)
    print(legend)
    return text + "\n" + legend


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test, e.g. on the CPU)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names to run (default: all of the chosen size)")
    parser.add_argument("--min-ms", type=float, default=1500.0,
                        help="device time per variant to time, at least (more rounds: steadier medians)")
    parser.add_argument("--out", default=None, help="folder for bench_layernorm_modules.json")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (use --device cpu --tiny for a smoke test)")
    cases = TINY_CASES if args.tiny else CASES
    cases = chosen_by_name(parser, "--cases", cases, args.cases)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    started = time.perf_counter()
    results = []
    for case in tqdm(cases, desc="blocks", unit="block", disable=args.quiet):
        results.append(bench_case(case, device, dtype, args.min_ms))
    text = table(results, args.dtype)
    elapsed = time.perf_counter() - started
    print(f"{len(results)} blocks in {elapsed:.1f} s on {device_description() if device.type == 'cuda' else 'cpu'}")
    if args.out:
        path = write_results(args.out, "bench_layernorm_modules", {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_description() if device.type == "cuda" else "cpu", "dtype": args.dtype,
            "torch": torch.__version__, "seconds": elapsed, "cases": results, "table": text})
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
