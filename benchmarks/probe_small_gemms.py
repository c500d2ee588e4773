"""Where splitgrad's GEMMs trail PyTorch's on small shapes (issue 15): which kernels each side runs
and how long they take, with PyTorch on cuBLAS and on cuBLASLt (its two BLAS back ends).

    python benchmarks/probe_small_gemms.py [--out out]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_gemm import wgrad_variants  # noqa: E402  (also registers torch.ops.splitgrad)
from common import print_table, time_side_by_side, write_results  # noqa: E402

OPS = torch.ops.splitgrad

# (product, tokens, in, out): the rows of BENCHMARKS.md's tables above 1.00x of PyTorch.
CASES = [
    ("wgrad", 2048, 1024, 1024), ("wgrad", 2048, 4096, 4096), ("wgrad", 8192, 4096, 6144),
    ("wgrad", 8192, 14336, 4096),
    ("fprop", 2048, 1024, 1024), ("fprop", 8192, 8192, 1280), ("fprop", 512, 1536, 4096),
    ("fprop", 1024, 4096, 1536), ("fprop+bias", 2048, 1024, 1024), ("fprop+bias", 128, 4096, 1536),
    ("fprop+bias", 512, 1536, 4096), ("dgrad", 128, 4096, 1536), ("dgrad", 128, 1536, 4096),
    ("dgrad", 512, 4096, 1536), ("dgrad", 1024, 1536, 4096), ("dgrad", 2048, 1024, 1024),
]


def contenders(product, tokens, fin, fout):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(fout, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16, generator=g)
    if product == "wgrad":  # bench_gemm.py's contenders: into an fp32 main_grad, PyTorch's in-place addmm
        variants = wgrad_variants(dy, x, torch.zeros(fout, fin, device="cuda"), torch.zeros(fout, device="cuda"))
        ours, theirs = variants["splitgrad"], variants["(c) addmm"]
    elif product == "fprop":
        ours, theirs = (lambda: OPS.linear_fprop(x, w, None)), (lambda: F.linear(x, w))
    elif product == "fprop+bias":
        ours, theirs = (lambda: OPS.linear_fprop(x, w, b)), (lambda: F.linear(x, w, b))
    else:
        ours, theirs = (lambda: OPS.linear_dgrad(dy, w)), (lambda: torch.matmul(dy, w))
    return ours, theirs


def with_blas(library, fn):
    def call():
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
    return call


def kernels(fn):
    """(name, µs) of each kernel one call of fn() launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:90], round(e.device_time, 1)) for e in prof.events() if e.device_time > 0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.backends.cuda.preferred_blas_library("cublas")
    rows, records = [], []
    for product, tokens, fin, fout in CASES:
        ours, theirs = contenders(product, tokens, fin, fout)
        fns = {"splitgrad": ours, "torch cublas": with_blas("cublas", theirs),
               "torch cublaslt": with_blas("cublaslt", theirs)}
        t = time_side_by_side(fns, min_ms=100.0)
        found = {name: kernels(fn) for name, fn in fns.items()}
        rows.append([product, tokens, f"{fin}->{fout}", f"{t['splitgrad'] * 1e3:.1f}",
                     f"{t['splitgrad'] / t['torch cublas']:.3f}", f"{t['splitgrad'] / t['torch cublaslt']:.3f}"])
        records.append({"product": product, "tokens": tokens, "in": fin, "out": fout, "ms": t, "kernels": found})
        for name, names in found.items():
            print(f"  {product} {tokens} {fin}->{fout} {name}: {names}")
    print_table("splitgrad against PyTorch's two BLAS back ends",
                ["product", "tokens", "in->out", "splitgrad µs", "vs torch cublas", "vs torch cublaslt"], rows)
    if args.out:
        write_results(args.out, "probe_small_gemms", {"cases": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
