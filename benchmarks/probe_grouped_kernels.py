r"""Which GPU kernels each fprop / dgrad contender of bench_grouped.py launches on one shape, and for
how long (torch.profiler): cuBLAS's kernel (tile, cluster, split-K or stream-K, in its name) per
expert of the loop against the one grouped kernel of torch._grouped_mm and of splitgrad. A probe
for choosing kernels, not a benchmark: one profiled call after warmup.

    bash scripts/gpu_run.sh python benchmarks/probe_grouped_kernels.py --shapes dsv3-gate-up-8

Under Nsight Compute (--plain: each chosen contender runs once, warm, without torch.profiler):

    ncu --clock-control none -k regex:'device_kernel|nvjet' \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
        python benchmarks/probe_grouped_kernels.py --plain --only 'fprop loop' 'fprop splitgrad dev'

(each contender's kernels are profiled twice: the warm call and the one after it).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_grouped import SHAPES, Data, fprop_dgrad_contenders, imbalanced_splits  # noqa: E402
from common import chosen_by_name, cuda_kernels_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv3-gate-up-8", help="comma-separated shape names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="contender names (default: all)")
    parser.add_argument("--plain", action="store_true", help="run each contender once, not profiled (for ncu)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    for shape in chosen_by_name(parser, "--shapes", SHAPES, args.shapes):
        splits = imbalanced_splits(shape.tokens, shape.experts, args.seed, 16)
        print(f"{shape.name}: {shape.describe()}, splits {splits}")
        d = Data(shape, splits, torch.device("cuda"), torch.bfloat16)
        for name, fn in fprop_dgrad_contenders(d).items():
            if args.only is not None and name not in args.only:
                continue
            if args.plain:
                fn()  # warm (cuBLAS's heuristics, the first launch), then the run ncu profiles
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(name)
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                continue
            try:
                launched = cuda_kernels_of(fn)
            except RuntimeError as error:
                print(f"  {name}: failed: {str(error).splitlines()[0]}")
                continue
            print(f"  {name}: {len(launched)} kernels, {sum(t for _, t in launched):.1f} µs")
            for kernel, time_us in launched:  # in launch order: a loop's are per expert
                print(f"    {time_us:9.1f} µs  {kernel[:160]}")


if __name__ == "__main__":
    main()
