"""benchmarks/bench_activation.py at its tiny size on the CPU (the splitgrad ops' ATen path): every
contender of every case runs, splitgrad's results equal PyTorch's, and the tables and files say so."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest
import torch

import splitgrad  # noqa: F401  (registers torch.ops.splitgrad)

ROOT = pathlib.Path(__file__).resolve().parents[2]

needs_aten_kernel = pytest.mark.skipif(
    not torch._C._dispatch_has_kernel_for_dispatch_key("splitgrad::activation", "CompositeExplicitAutograd"),
    reason="splitgrad::activation has no ATen (CPU) kernel in this build: src/aten/activation_aten.cpp comes "
           "with issue 14's LayerNormMLP branch",
)


def load_bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("bench_activation")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@needs_aten_kernel
def test_tiny_cpu_run_times_every_contender_and_they_agree(tmp_path, capsys):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--tiny", "--quiet", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_activation.json").read_text())
    assert payload["skipped"] == {}
    cases = [(r["shape"], r["activation"]) for r in payload["results"]]
    assert cases == [(s.name, a) for s in bench.TINY_SHAPES for a in bench.GATED]
    for r in payload["results"]:
        assert set(r["ms"]) == set(bench.CONTENDERS) and all(ms > 0 for ms in r["ms"].values()), r
        assert r["checks"]["fwd"] == "equal", r
        # the ATen path's backward is autograd's formula: equal, or off by float32 rounding at most
        assert r["checks"]["bwd"] == "equal" or float(r["checks"]["bwd"].split()[-1]) < 1e-5, r
        assert r["bytes"]["fwd"] == 3 * r["tokens"] * r["ffn"] * 4  # float32 on the CPU
    printed = capsys.readouterr().out
    assert "splitgrad / torch" in printed and "tiny-odd (7 x 2·5)" in printed
    markdown = (tmp_path / "bench_activation.md").read_text()
    assert markdown.startswith("`python benchmarks/bench_activation.py --device cpu --tiny")
    assert "| shape | activation | op | torch µs |" in markdown


def test_a_wrong_result_is_visible():
    """The agreement column compares real results."""
    bench = load_bench()
    x = torch.randn(4, 8)
    assert bench.agreement(bench.composite("swiglu", x), bench.composite("swiglu", x)) == "equal"
    assert bench.agreement(bench.composite("swiglu", x), bench.composite("geglu", x)).startswith("max diff ")


def test_unknown_names_are_refused(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--activations", "swish"])
    assert "--activations: unknown ['swish']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--shapes", "llama-70b-ffn"])
    assert "--shapes: unknown ['llama-70b-ffn']" in capsys.readouterr().err
