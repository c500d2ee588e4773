"""Which GPU kernels one call of each splitgrad op launches, and for how long (torch.profiler).
Shows, for example, the wgrad GEMM next to the bias gradient's two column-sum kernels, and how
long each takes against PyTorch's dy.sum(0).

    python benchmarks/profile_kernels.py [--tokens 8192] [--hidden 4096]
"""

import argparse
import sys

import torch

import splitgrad  # noqa: F401

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import cuda_kernels_of  # noqa: E402


def show(label, fn):
    print(f"{label}:")
    for name, time_us in cuda_kernels_of(fn):
        print(f"    {time_us:9.1f} µs  {name[:110]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    t, h = args.tokens, args.hidden
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(h, h, device="cuda")
    bias_main_grad = torch.zeros(h, device="cuda")
    ops = torch.ops.splitgrad
    show("wgrad_accumulate_ into fp32 main_grad, no bias", lambda: ops.linear_wgrad_accumulate_(dy, x, main_grad, None))
    show("wgrad_accumulate_ into fp32 main_grad, with bias", lambda: ops.linear_wgrad_accumulate_(dy, x, main_grad, bias_main_grad))
    show("wgrad fresh bf16, with bias", lambda: ops.linear_wgrad(dy, x, True))
    show("wgrad fresh bf16, no bias", lambda: ops.linear_wgrad(dy, x, False))
    show("dy.sum(0) alone", lambda: dy.sum(0))


if __name__ == "__main__":
    main()
