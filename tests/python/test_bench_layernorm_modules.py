"""benchmarks/bench_layernorm_modules.py at its tiny size on the CPU: every block runs in every
variant, their gradients agree, and the table and JSON say so."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("bench_layernorm_modules")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_tiny_cpu_run_times_every_variant_and_their_gradients_agree(tmp_path, capsys):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--quiet", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_layernorm_modules.json").read_text())
    assert [c["name"] for c in payload["cases"]] == ["mlp-tiny", "mlp-tiny-gelu", "qkv-tiny"]
    for case in payload["cases"]:
        assert set(case["ms"]) == set(bench.VARIANTS) and all(ms > 0 for ms in case["ms"].values()), case
        # the same weights and data: float32 gradients agree to rounding (fused vs separate adds)
        assert all(d < 1e-5 for d in case["relative_gradient_difference"].values()), case
        assert case["relative_gradient_difference"]["plain"] == 0.0
    printed = capsys.readouterr().out
    assert "vs Linear-built" in printed and "qkv-tiny | Linear-built" in printed
    assert "LayerNormMLP 64 / ffn 192, RMSNorm, swiglu, 128 tokens" in printed


def test_a_gradient_mismatch_is_visible(monkeypatch):
    """The gradient check compares real gradients: a variant computing another function shows."""
    bench = load_bench()
    import torch

    case = bench.TINY_CASES[1]
    variants = bench.build_variants(case, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        variants["Linear-built"].module.fc2.weight.mul_(2)
    x = torch.randn(case.tokens, case.hidden, requires_grad=True)
    dy = torch.randn(case.tokens, case.hidden)
    differences = bench.gradient_differences(variants, x, dy)
    assert differences["splitgrad"] < 1e-5 and differences["Linear-built"] > 1e-2, differences


def test_unknown_case_is_refused(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--cases", "mlp-huge"])
    assert "--cases: unknown ['mlp-huge']" in capsys.readouterr().err
