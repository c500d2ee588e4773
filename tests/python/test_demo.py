"""The main job (examples/demo.py) end to end, in a short configuration: it must report parity with
plain autograd and write its loss-curve PNG."""

import importlib.util
import pathlib

import pytest

DEMO = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("splitgrad_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_reports_parity_and_writes_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the demo's loss curve needs matplotlib (installed by scripts/env.sh)")
    demo = load_demo()
    status = demo.main(["--steps", "4", "--micro-batches", "3", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "PARITY OK" in printed
    assert "largest gradient difference vs plain autograd" in printed
    png = tmp_path / "demo_loss.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_fails_when_the_tolerance_is_impossible(tmp_path, capsys):
    """The parity check can fail: with a negative tolerance no gradient difference passes."""
    demo = load_demo()
    status = demo.main(["--steps", "1", "--micro-batches", "2", "--tolerance", "-1", "--out", str(tmp_path)])
    assert status == 1
    assert "PARITY FAILED" in capsys.readouterr().out
