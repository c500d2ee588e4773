"""Tile, cluster, schedule and tile-order variants of splitgrad's SM90 grouped GEMMs, side by side
with the shipped kernels and PyTorch's contenders on bench_grouped.py's shapes: what picks the
kernels in src/cuda/grouped_gemm.cpp.

Needs a tuning build, which also compiles the variants listed in src/cuda/sm90/CMakeLists.txt
(all of them, or those whose names match -DSPLITGRAD_GROUPED_GEMM_TUNING_VARIANTS=<regex>; the
others are then reported as skipped):

    SPLITGRAD_CMAKE_ARGS=-DSPLITGRAD_GROUPED_GEMM_TUNING=ON bash scripts/gpu_run.sh build
    bash scripts/gpu_run.sh python benchmarks/tune_grouped.py --out out

Pass 1 times, per shape and product (fprop, dgrad, wgrad into fp32 main_grad, wgrad_bf16 into fresh
bf16 gradients), the shipped kernel ("default"), every variant (SPLITGRAD_GROUPED_GEMM_VARIANT=<name>)
and PyTorch's contenders. Pass 2 times the pass-1 winner under each raster order and swizzle of
CUTLASS's persistent scheduler (SPLITGRAD_GROUPED_GEMM_RASTER=m|n, SPLITGRAD_GROUPED_GEMM_SWIZZLE=1|2|4|8).
A variant that cannot run raises (a tuning build never times the fallback loop in its place) and is
reported as skipped. Every result is checked against an fp32 reference before timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import sys
import time
from typing import Callable

import torch
from tqdm import tqdm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_grouped import (SHAPES, Data, fprop_dgrad_contenders, imbalanced_splits,  # noqa: E402
                           markdown_table, relative_error, wgrad_contenders)
from common import available, chosen_by_name, device_description, time_side_by_side, write_results  # noqa: E402

SM90_CMAKE = pathlib.Path(__file__).resolve().parents[1] / "src" / "cuda" / "sm90" / "CMakeLists.txt"


def tuning_variants(cmake: pathlib.Path = SM90_CMAKE) -> dict[str, list[str]]:
    """The tuning build's variant names by product, read from the list that compiles them
    (src/cuda/sm90/CMakeLists.txt's `set(variants ...)`: one "name product tile..." entry each)."""
    listed = re.search(r"set\(variants\n(.*?)\)\n", cmake.read_text(), re.S)
    if listed is None:
        raise RuntimeError(f"{cmake}: no set(variants ...) list")
    variants = {"fprop": [], "dgrad": [], "wgrad": [], "wgrad_bf16": []}
    for name, product in re.findall(r'"(\S+) (\S+) ', listed.group(1)):
        variants["wgrad" if product == "wgrad_fp32" else product].append(name)
    return variants


VARIANTS = tuning_variants()
ORDERS = [(raster, swizzle) for raster in ("m", "n") for swizzle in (1, 2, 4, 8)]
ENV_KEYS = ("SPLITGRAD_GROUPED_GEMM_VARIANT", "SPLITGRAD_GROUPED_GEMM_RASTER", "SPLITGRAD_GROUPED_GEMM_SWIZZLE",
            "SPLITGRAD_GROUPED_WGRAD_SCHEDULE")


def under_env(fn: Callable[[], object], env: dict[str, str]) -> Callable[[], object]:
    """fn() with these environment variables set (and every other tuning variable unset)."""

    def call():
        saved = {key: os.environ.pop(key, None) for key in ENV_KEYS}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for key in ENV_KEYS:
                os.environ.pop(key, None)
                if saved[key] is not None:
                    os.environ[key] = saved[key]

    return call


def products(d: Data) -> dict[str, tuple[dict[str, Callable[[], object]], Callable[[], object], Callable]]:
    """product -> (PyTorch's contenders, splitgrad's call with device splits, the fp32 reference):
    bench_grouped.py's contenders, each returning its result."""
    fd, wg = fprop_dgrad_contenders(d), wgrad_contenders(d)

    def wgrad_reference():
        return torch.stack([dy.float().t() @ x.float() for dy, x in zip(d.dys, d.xs)])

    def into_main_grad(fn):
        return lambda: (fn(), d.main_grad)[1]

    return {
        "fprop": ({"loop": fd["fprop loop"], "grouped_mm": fd["fprop gmm"]}, fd["fprop splitgrad dev"],
                  lambda: torch.cat([x.float() @ w.float().t() for x, w in zip(d.xs, d.ws)])),
        "dgrad": ({"loop": fd["dgrad loop"], "grouped_mm": fd["dgrad gmm"]}, fd["dgrad splitgrad dev"],
                  lambda: torch.cat([dy.float() @ w.float() for dy, w in zip(d.dys, d.ws)])),
        "wgrad": ({"addmm loop": into_main_grad(wg["(a) addmm loop"]), "gmm floor": wg["(c) gmm floor"]},
                  into_main_grad(wg["(d) splitgrad dev"]), wgrad_reference),
        "wgrad_bf16": ({"gmm floor": wg["(c) gmm floor"]}, wg["(f) splitgrad fresh"], wgrad_reference),
    }


def checked(name: str, fn, d: Data, want: torch.Tensor, product: str, errors: dict) -> None:
    d.zero_()
    out = fn()
    if product == "wgrad" and name.startswith("gmm"):
        return
    if isinstance(out, (list, tuple)):  # splitgrad's fresh gradients, one per expert
        out = torch.stack(out)
    errors[name] = relative_error(out, want)
    if errors[name] > 2e-2:
        raise RuntimeError(f"{name}: max relative error {errors[name]:.2e} against fp32")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--products", default="fprop,dgrad,wgrad,wgrad_bf16",
                        help="wgrad: into fp32 main_grads; wgrad_bf16: into fresh bf16 .grads")
    parser.add_argument("--min-ms", type=float, default=40.0, help="device time per contender, at least")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--all-orders", action="store_true",
                        help="pass 2 for every kernel (raster m and n, swizzle 1 and 2), not only pass 1's winner")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (Hopper) and a tuning build")
    shapes = chosen_by_name(parser, "--shapes", SHAPES, args.shapes)
    wanted = args.products.split(",")
    device, started, rows, skipped = torch.device("cuda"), time.perf_counter(), [], []
    for shape in tqdm(shapes, desc="shapes", unit="shape", disable=args.quiet):
        splits = imbalanced_splits(shape.tokens, shape.experts, args.seed, 16)
        torch.manual_seed(args.seed)
        d = Data(shape, splits, device, torch.bfloat16)
        for product, (theirs, ours, reference) in products(d).items():
            if product not in wanted:
                continue
            want = reference()
            envs = {"default": {}} | {v: {"SPLITGRAD_GROUPED_GEMM_VARIANT": v} for v in VARIANTS[product]}
            if product == "wgrad":  # the shipped fp32 kernels, each forced
                envs |= {f"shipped {schedule}": {"SPLITGRAD_GROUPED_WGRAD_SCHEDULE": schedule}
                         for schedule in ("pingpong", "cooperative")}
            kernels = {name: under_env(ours, env) for name, env in envs.items()}
            reasons = {}
            kernels = available(kernels, reasons)
            errors = {}
            for name, fn in list(kernels.items()):
                try:
                    checked(name, fn, d, want, product, errors)
                except RuntimeError as error:
                    reasons[name] = str(error)
                    del kernels[name]
            skipped += [f"{shape.name} {product} {name}: {why}" for name, why in reasons.items()]
            first = time_side_by_side(theirs | kernels, min_ms=args.min_ms)
            best = min(kernels, key=lambda name: first[name])
            ordered = {}
            for kernel in list(kernels) if args.all_orders else [best]:
                env = envs[kernel]
                for r, s in ORDERS if not args.all_orders else [("m", 1), ("n", 1), ("n", 2)]:
                    ordered[f"{kernel} {r}{s}"] = under_env(ours, env | {"SPLITGRAD_GROUPED_GEMM_RASTER": r,
                                                                         "SPLITGRAD_GROUPED_GEMM_SWIZZLE": str(s)})
            for name, fn in ordered.items():
                checked(name, fn, d, want, product, errors)
            second = time_side_by_side(theirs | {best: kernels[best]} | ordered, min_ms=args.min_ms)
            reference_name = "addmm loop" if product == "wgrad" else min(theirs, key=lambda n: first[n])
            rows.append({"shape": shape.name, "product": product, "pass1": first, "pass2": second,
                         "best": best, "reference": reference_name, "errors": errors})
        del d
        torch.cuda.empty_cache()

    text = []
    for row in rows:
        for which, title in (("pass1", f"pass 1 (vs {row['reference']})"),
                             ("pass2", "pass 2, tile orders (raster m|n, swizzle)")):
            ref = row[which][row["reference"]]
            table = [[name, f"{ms * 1e3:.1f}", f"{ms / ref:.3f}"]
                     for name, ms in sorted(row[which].items(), key=lambda kv: kv[1])]
            text.append(f"#### {row['shape']} {row['product']}: {title}\n\n"
                        + markdown_table(["kernel", "µs", "ratio"], table))
    text += [f"skipped: {line}" for line in skipped]
    print("\n\n".join(text))
    elapsed = time.perf_counter() - started
    print(f"{len(rows)} shape-products in {elapsed:.1f} s on {device_description()}")
    if args.out:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        write_results(args.out, "tune_grouped", {"date": date, "device": device_description(),
                                                 "torch": torch.__version__, "rows": rows, "skipped": skipped,
                                                 "seconds": elapsed})
        with open(f"{args.out}/tune_grouped.md", "w") as f:
            f.write(f"{date}, {device_description()}\n\n" + "\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
