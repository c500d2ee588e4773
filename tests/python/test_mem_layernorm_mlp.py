"""benchmarks/mem_layernorm_mlp.py at a small size on the CPU: what it reports about the delayed
LayerNormMLP's peak (BENCHMARKS.md) stays true — keeping fc2's input for its deferred wgrad would
hold exactly that input more than recomputing it from fc1's output, and splitgrad's delayed module,
which keeps fc1's output and recomputes the activation in backward_dw(), peaks no higher than plain
PyTorch nor than the recomputing emulation (as the immediate module)."""

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
def test_delayed_module_keeps_fc1s_output_and_peaks_no_higher_than_plain(mem, activation):
    hidden, ffn, tokens = 64, 224, 256
    unit = tokens * ffn * 2  # fc2's input in bf16
    peaks = {name: peak for name, (peak, _, _) in
             mem.measure(hidden, ffn, tokens, activation, "LayerNorm", torch.bfloat16).items()}
    plain, delayed, immediate, keeps_input, recompute = (peaks[name] for name in mem.VARIANTS)
    slack = unit // 20  # the norm's statistics, bias gradients: small next to a unit
    assert abs(keeps_input - recompute - unit) <= slack, peaks  # what keeping fc2's input costs
    assert delayed <= plain + slack and delayed <= recompute + slack, peaks
    assert abs(delayed - immediate) <= slack, peaks
    if activation == "gelu":  # no gated gradient to assemble: the emulation's peak exactly
        assert abs(delayed - recompute) <= slack, peaks
    else:  # SwiGLU's gradient written in halves into one result, not made twice and concatenated
        assert abs(recompute - delayed - unit) <= slack, peaks


def test_cli_prints_the_table(mem, capsys):
    assert mem.main(["--hidden", "32", "--ffn", "96", "--tokens", "64", "--activation", "reglu"]) == 0
    out = capsys.readouterr().out
    assert "| splitgrad delayed |" in out and "fc2 keeps fc1's output (recompute)" in out
