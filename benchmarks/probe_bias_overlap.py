"""Probe for the bias gradient inside the wgrad GEMM's time (issue 15): what running splitgrad's
column-sum kernel on a second stream, concurrently with the bias-free wgrad GEMM, would give, before
building it into the op. Side by side per shape of bench_gemm.py's wgrad table (2048 tokens up):

- ``without``: the wgrad GEMM into fp32 main_grad, no bias;
- ``sequential``: today's op with the bias target (GEMM, then the column sum);
- ``overlap, bias first``: the column sum launched first on a side stream, the GEMM on the current
  one, then joined (the column sum takes SMs before the GEMM fills them);
- ``overlap, gemm first``: the GEMM first, the column sum on the side stream after it.

    bash scripts/gpu_run.sh python benchmarks/probe_bias_overlap.py --out out
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_gemm import WGRAD, shapes  # noqa: E402
from common import device_description, print_table, time_side_by_side, write_results  # noqa: E402


def contenders(dy, x, main_grad, bias_main_grad, side):
    no_weight, no_weight_grad = x[:, :0], main_grad[:, :0]  # the bias kernel alone

    def overlap(bias_first):
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        if bias_first:
            with torch.cuda.stream(side):
                WGRAD(dy, no_weight, no_weight_grad, bias_main_grad)
            WGRAD(dy, x, main_grad, None)
        else:
            WGRAD(dy, x, main_grad, None)
            with torch.cuda.stream(side):
                WGRAD(dy, no_weight, no_weight_grad, bias_main_grad)
        current.wait_stream(side)

    return {
        "without": lambda: WGRAD(dy, x, main_grad, None),
        "sequential": lambda: WGRAD(dy, x, main_grad, bias_main_grad),
        "overlap, bias first": lambda: overlap(True),
        "overlap, gemm first": lambda: overlap(False),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-ms", type=float, default=40.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    side, rows, results = torch.cuda.Stream(), [], []
    for label, tokens, fin, fout in tqdm([s for s in shapes(False) if s[1] >= 2048], disable=args.quiet):
        dy = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(fout, fin, device="cuda")
        bias_main_grad = torch.zeros(fout, device="cuda")
        ms = time_side_by_side(contenders(dy, x, main_grad, bias_main_grad, side), min_ms=args.min_ms)
        base = ms["without"]
        rows.append([label, tokens, f"{base * 1e3:.1f}"] + [f"{ms[k] / base - 1:+.1%}" for k in list(ms)[1:]])
        results.append({"shape": label, "tokens": tokens, "ms": ms})
    print_table("wgrad with the bias gradient, over the same wgrad without it",
                ["shape", "tokens", "without µs", "sequential", "overlap, bias first", "overlap, gemm first"], rows)
    if args.out:
        write_results(args.out, "probe_bias_overlap", {"device": device_description(), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
