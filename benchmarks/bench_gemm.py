"""The three linear-layer GEMMs on the GPU: splitgrad's cuBLASLt back end vs PyTorch, side by side.

wgrad into an fp32 main_grad (the fused path, with and without the bias gradient) against
  (a) a bare bf16 torch.mm of the same shape (the floor: no accumulation at all),
  (b) torch.mm, then main_grad.add_() (Megatron without fusion),
  (c) torch.addmm(main_grad, dyᵀ, x, out_dtype=float32, out=main_grad) (+ dy.sum(0) for the bias),
      PyTorch's best in-place alternative;
accumulated over 1, 4 and 16 micro-batches; and fprop / dgrad against F.linear / torch.matmul.

    python benchmarks/bench_gemm.py [--quick] [--out out]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import BF16_PEAK_TFLOPS, device_description, peak_memory_bytes, print_table, tflops, time_side_by_side, write_results  # noqa: E402

import splitgrad  # noqa: E402,F401  (registers torch.ops.splitgrad)

WGRAD = torch.ops.splitgrad.linear_wgrad_accumulate_


def shapes(quick: bool):
    """(label, tokens, in_features, out_features)."""
    square = [(f"square {h}", t, h, h) for h in (1024, 4096, 8192) for t in (2048, 8192, 16384)]
    llama = [(f"llama3-8b {i}->{o}", 8192, i, o) for i, o in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))]
    skinny = [("tp skinny 8192->1280", 8192, 8192, 1280), ("tp skinny 1024->8192", 8192, 1024, 8192)]
    moe = [(f"moe expert {i}->{o}", t, i, o) for t in (128, 512, 1024) for i, o in ((4096, 1536), (1536, 4096))]
    if quick:
        return square[3:5] + llama[:2] + skinny[:1] + moe[:2]
    return square + llama + skinny + moe


def wgrad_variants(dy, x, main_grad, bias_main_grad):
    """The contenders, each accumulating into the same buffers: without the bias gradient, with
    it ("+b"), and the bias gradient alone (splitgrad's column-sum kernel against dy.sum)."""
    no_weight = x[:, :0]  # a product with no columns: splitgrad then runs only the bias kernel
    no_weight_grad = main_grad[:, :0]

    def mm_then_add(with_bias):
        main_grad.add_(torch.mm(dy.t(), x))
        if with_bias:
            bias_main_grad.add_(dy.sum(0))

    def addmm(with_bias):
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
        if with_bias:
            bias_main_grad.add_(dy.sum(0, dtype=torch.float32))

    return {
        "splitgrad": lambda: WGRAD(dy, x, main_grad, None),
        "splitgrad+b": lambda: WGRAD(dy, x, main_grad, bias_main_grad),
        "(a) bf16 mm": lambda: torch.mm(dy.t(), x),
        "(b) mm+add_": lambda: mm_then_add(False),
        "(b) mm+add_+b": lambda: mm_then_add(True),
        "(c) addmm": lambda: addmm(False),
        "(c) addmm+b": lambda: addmm(True),
        "bias kernel": lambda: WGRAD(dy, no_weight, no_weight_grad, bias_main_grad),
        "dy.sum+add_": lambda: bias_main_grad.add_(dy.sum(0, dtype=torch.float32)),
    }


def bench_wgrad(args, results):
    rows, bias_rows = [], []
    for label, tokens, fin, fout in tqdm(shapes(args.quick), desc="wgrad into fp32 main_grad", unit="shape"):
        x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(fout, fin, device="cuda")
        bias_main_grad = torch.zeros(fout, device="cuda")
        variants = wgrad_variants(dy, x, main_grad, bias_main_grad)
        t = time_side_by_side(variants)
        memory = {name: peak_memory_bytes(variants[name]) for name in ("splitgrad", "splitgrad+b", "(b) mm+add_")}
        flop = 2.0 * tokens * fin * fout
        for with_bias in (False, True):
            suffix = "+b" if with_bias else ""
            ours = t["splitgrad" + suffix]
            rows.append([
                label, tokens, "yes" if with_bias else "no",
                f"{ours * 1e3:.1f}", f"{tflops(flop, ours):.0f}", f"{100 * tflops(flop, ours) / BF16_PEAK_TFLOPS:.0f}%",
                f"{ours / t['(a) bf16 mm']:.3f}", f"{ours / t['(b) mm+add_' + suffix]:.3f}",
                f"{ours / t['(c) addmm' + suffix]:.3f}", f"{memory['splitgrad' + suffix] / 2**20:.1f}",
                f"{memory['(b) mm+add_'] / 2**20:.1f}",
            ])
        dy_bytes = dy.numel() * dy.element_size()
        bias_rows.append([
            label, tokens, f"{100 * (t['splitgrad+b'] / t['splitgrad'] - 1):+.1f}%",
            f"{t['bias kernel'] * 1e3:.1f}", f"{dy_bytes / (t['bias kernel'] * 1e-3) / 1e9:.0f}",
            f"{t['bias kernel'] / t['dy.sum+add_']:.3f}", f"{100 * t['bias kernel'] / t['splitgrad']:.1f}%",
        ])
        results["wgrad"].append({"shape": label, "tokens": tokens, "in": fin, "out": fout, "ms": t, "peak_bytes": memory})
        del x, dy, main_grad, bias_main_grad
    columns = ["shape", "tokens", "bias", "splitgrad µs", "TFLOP/s", "% peak", "vs (a) mm", "vs (b) mm+add_",
               "vs (c) addmm", "extra MiB", "(b) extra MiB"]
    bias_columns = ["shape", "tokens", "with bias vs without", "bias kernel µs", "GB/s read", "vs dy.sum+add_",
                    "kernel / GEMM"]
    return "\n\n".join([
        print_table("wgrad into fp32 main_grad (bf16 inputs): time ratios < 1 mean splitgrad is faster", columns, rows),
        print_table("the bias gradient: splitgrad with it vs without it, and its column-sum kernel alone", bias_columns,
                    bias_rows),
    ])


def bench_microbatches(args, results):
    rows = []
    cases = [(s, m) for s in shapes(args.quick) if s[0].startswith("llama") for m in (1, 4, 16)]
    for (label, tokens, fin, fout), count in tqdm(cases, desc="micro-batch accumulation", unit="case"):
        xs = [torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        dys = [torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        main_grad = torch.zeros(fout, fin, device="cuda")

        def ours():
            for dy, x in zip(dys, xs):
                WGRAD(dy, x, main_grad, None)

        def addmm():
            for dy, x in zip(dys, xs):
                torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)

        def mm_add():
            for dy, x in zip(dys, xs):
                main_grad.add_(torch.mm(dy.t(), x))

        t = time_side_by_side({"ours": ours, "addmm": addmm, "mm_add": mm_add}, min_ms=30)
        t_ours, t_addmm, t_mm_add = t["ours"], t["addmm"], t["mm_add"]
        rows.append([label, count, f"{t_ours * 1e3:.0f}", f"{t_ours / t_addmm:.3f}", f"{t_ours / t_mm_add:.3f}"])
        results["microbatches"].append({"shape": label, "micro_batches": count, "ms": {"splitgrad": t_ours, "addmm": t_addmm, "mm+add_": t_mm_add}})
        del xs, dys, main_grad
    return print_table("wgrad accumulated over micro-batches into one main_grad", ["shape", "micro-batches", "splitgrad µs", "vs (c) addmm", "vs (b) mm+add_"], rows)


def bench_fprop_dgrad(args, results):
    rows = []
    for label, tokens, fin, fout in tqdm(shapes(args.quick), desc="fprop and dgrad", unit="shape"):
        x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(fout, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16)
        # One pair at a time: each contender then follows its rival (same operands, as warm in
        # L2) or nothing, alike for both; in one six-way rotation PyTorch's call would always
        # follow splitgrad's on the same operands, and splitgrad's a product on other ones.
        t = {}
        for pair in ({"fprop": lambda: torch.ops.splitgrad.linear_fprop(x, w, None),
                      "F.linear": lambda: F.linear(x, w)},
                     {"fprop+bias": lambda: torch.ops.splitgrad.linear_fprop(x, w, b),
                      "F.linear+bias": lambda: F.linear(x, w, b)},
                     {"dgrad": lambda: torch.ops.splitgrad.linear_dgrad(dy, w),
                      "matmul": lambda: torch.matmul(dy, w)}):
            t.update(time_side_by_side(pair))
        flop = 2.0 * tokens * fin * fout
        rows.append([label, tokens, f"{t['fprop'] * 1e3:.1f}", f"{tflops(flop, t['fprop']):.0f}", f"{t['fprop'] / t['F.linear']:.3f}",
                     f"{t['fprop+bias'] / t['F.linear+bias']:.3f}", f"{t['dgrad'] * 1e3:.1f}", f"{t['dgrad'] / t['matmul']:.3f}"])
        results["fprop_dgrad"].append({"shape": label, "tokens": tokens, "in": fin, "out": fout, "ms": t})
        del x, w, b, dy
    columns = ["shape", "tokens", "fprop µs", "TFLOP/s", "vs F.linear", "+bias vs F.linear", "dgrad µs", "vs matmul"]
    return print_table("fprop and dgrad (bf16)", columns, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--out", default="out")
    parser.add_argument("--only", choices=["wgrad", "microbatches", "fprop_dgrad"], nargs="*")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm: needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    results = {"date": datetime.date.today().isoformat(), "device": device_description(), "command": " ".join(sys.argv),
               "wgrad": [], "microbatches": [], "fprop_dgrad": []}
    print(f"device: {results['device']}")
    tables = []
    wanted = args.only or ["wgrad", "microbatches", "fprop_dgrad"]
    if "wgrad" in wanted:
        tables.append(bench_wgrad(args, results))
    if "microbatches" in wanted:
        tables.append(bench_microbatches(args, results))
    if "fprop_dgrad" in wanted:
        tables.append(bench_fprop_dgrad(args, results))
    results["tables"] = tables
    print("results:", write_results(args.out, "bench_gemm", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
