"""benchmarks/mem_layernorm_mlp.py at a small size on the CPU: what it reports about the delayed
LayerNormMLP's peak (BENCHMARKS.md) stays true — the delayed module holds exactly fc2's input
more than plain PyTorch at the peak, and keeping fc1's output (recomputing the activation in
backward_dw) instead brings the peak back to plain's / the immediate module's."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mem():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("mem_layernorm_mlp")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_delayed_holds_fc2s_input_more_and_recompute_removes_it(mem, activation):
    hidden, ffn, tokens = 64, 224, 256
    unit = tokens * ffn * 2  # fc2's input in bf16
    peaks = {name: peak for name, (peak, _, _) in
             mem.measure(hidden, ffn, tokens, activation, "LayerNorm", torch.bfloat16).items()}
    plain, delayed, immediate, _, recompute = (peaks[name] for name in mem.VARIANTS)
    slack = unit // 20  # the norm's statistics, bias gradients: small next to a unit
    assert abs(delayed - immediate - unit) <= slack, peaks
    assert abs(recompute - immediate) <= slack, peaks
    assert immediate <= plain + slack, peaks


def test_cli_prints_the_table(mem, capsys):
    assert mem.main(["--hidden", "32", "--ffn", "96", "--tokens", "64", "--activation", "reglu"]) == 0
    out = capsys.readouterr().out
    assert "| splitgrad delayed |" in out and "fc2 keeps fc1's output (recompute)" in out
