"""benchmarks/bench_grouped.py at its tiny size on the CPU: every contender of every section runs,
computes what the per-expert reference computes, and the tables and files say so."""

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
        return importlib.import_module("bench_grouped")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_tiny_cpu_run_times_every_contender_and_they_agree(tmp_path, capsys):
    bench = load_bench()
    argv = ["--device", "cpu", "--tiny", "--quiet", "--host-reps", "5", "--host-warmup", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    payload = json.loads((tmp_path / "bench_grouped.json").read_text())
    assert [s["name"] for s in payload["shapes"]] == [s.name for s in bench.TINY_SHAPES]
    assert payload["skipped"] == {}  # on the CPU, PyTorch's grouped_mm runs its reference loop
    expected = {
        "wgrad": set(bench.WGRAD_KEYS),
        "fprop_dgrad": {f"{op} {who}" for op in ("fprop", "dgrad")
                        for who in ("loop", "gmm", "splitgrad dev", "splitgrad cpu")},
        "bias": {"splitgrad", "splitgrad+b", "splitgrad bias only", "addmm loop", "addmm+sum loop", "sum loop"},
    }
    for shape in payload["shapes"]:
        assert sum(shape["splits"]) == shape["tokens"] and len(shape["splits"]) == shape["experts"]
        for section, names in expected.items():
            assert set(shape[section]["ms"]) == names, (shape["name"], section)
            assert all(ms > 0 for ms in shape[section]["ms"].values())
            # float32 on the CPU: every contender computes the per-expert reference to rounding
            assert all(err < 1e-5 for err in shape[section]["max_rel_err"].values()), (shape["name"], section)
    host = payload["host"]
    assert set(host["median_us"]) == {"main_grad", ".grad fresh", ".grad kept"}
    for per_layer in host["median_us"].values():
        assert set(per_layer) == {"Linear", "GroupedLinear, list splits", "GroupedLinear, tensor splits"}
        assert all(us > 0 for us in per_layer.values())
    assert set(host["op_alone_median_us"]) == set(host["median_us"]["main_grad"])
    assert {t: set(v) for t, v in host["in_flight_median_us"].items()} == {t: set(v) for t, v in host["median_us"].items()}
    assert all(us > 0 for per_layer in host["in_flight_median_us"].values() for us in per_layer.values())
    assert all(us > 0 for us in host["op_alone_median_us"].values())
    assert host["threads"] == 1 and (host["features"], host["tokens"]) == bench.HOST_SIZES["cpu"]
    printed = capsys.readouterr().out
    assert "tiny-8 (8 x 32 -> 16, 256 tokens): splits [" in printed
    assert "(d)/(a)" in printed and "dev / best" in printed and "bias only / sum loop" in printed
    assert "host time of one backward_dw()" in printed
    markdown = (tmp_path / "bench_grouped.md").read_text()
    assert markdown.startswith("`python benchmarks/bench_grouped.py --device cpu --tiny")
    assert "| shape | (a) addmm loop |" in markdown


def test_splits_are_imbalanced_deterministic_and_aligned():
    bench = load_bench()
    splits = bench.imbalanced_splits(16384, 32, seed=0, align=16)
    assert splits == bench.imbalanced_splits(16384, 32, seed=0, align=16)
    assert splits != bench.imbalanced_splits(16384, 32, seed=1, align=16)
    assert sum(splits) == 16384 and all(s % 16 == 0 for s in splits)
    assert min(splits) == 16 and max(splits) > 5 * 16384 // 32  # one expert with few tokens, one hot
    two = bench.imbalanced_splits(8192, 2, seed=0, align=16)
    assert sum(two) == 8192 and max(two) > 1.5 * min(two)
    with pytest.raises(ValueError, match="cannot be split"):
        bench.imbalanced_splits(100, 8, seed=0, align=16)


def test_a_wrong_contender_is_visible(monkeypatch):
    """The reference check compares real results: a contender computing another product shows."""
    bench = load_bench()
    import torch

    shape = bench.TINY_SHAPES[0]
    data = bench.Data(shape, bench.imbalanced_splits(shape.tokens, shape.experts, 0, 16), torch.device("cpu"),
                      torch.float32)
    monkeypatch.setattr(bench, "addmm_into", lambda target, a, b: target.addmm_(a, b, alpha=2))
    errors = bench.wgrad_errors(data, bench.wgrad_contenders(data))
    assert errors["(a) addmm loop"] > 0.5 and errors["(d) splitgrad dev"] < 1e-5, errors
    assert errors["(f) splitgrad fresh"] < 1e-5, errors


def test_unknown_shape_is_refused(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--shapes", "dsv3-gate-up-8"])
    assert "--shapes: unknown ['dsv3-gate-up-8']" in capsys.readouterr().err


def test_host_profile_script_lists_the_grouped_ops_work_inside_backward_dw(capsys):
    """benchmarks/profile_grouped_host.py on the CPU: each case's time per backward_dw(), then
    the profiled entries inside it, where the grouped cases show the grouped op."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        profile = importlib.import_module("profile_grouped_host")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert profile.main(["--experts", "4", "--features", "8", "--tokens", "16", "--calls", "3", "--top", "40"]) == 0
    out = capsys.readouterr().out
    sections = out.split("\n\n")
    for case in ("Linear", "Grouped, list", "Grouped, tensor"):
        assert any(line.startswith(case) and "per backward_dw()" in line for line in sections[0].splitlines()), out
        section = next(s for s in sections[1:] if s.startswith(f"{case}: self CPU time inside backward_dw()"))
        op = "splitgrad::linear_wgrad_accumulate_" if case == "Linear" else "splitgrad::grouped_linear_wgrad_accumulate_"
        assert op in section, section


def test_tune_grouped_times_every_variant_the_tuning_build_compiles(tmp_path):
    """tune_grouped.py reads the variant names from the CMake list that compiles them: every entry,
    by product, and a list it cannot find is an error rather than nothing to time."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        tune = importlib.import_module("tune_grouped")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cmake = (ROOT / "src" / "cuda" / "sm90" / "CMakeLists.txt").read_text()
    entries = cmake[cmake.index("set(variants"):cmake.index("foreach(variant")].count('"') // 2
    prefixes = {"fprop": "f_", "dgrad": "d_", "wgrad": "w_", "wgrad_bf16": "wb_"}
    names = [name for product in prefixes for name in tune.VARIANTS[product]]
    assert len(names) == entries == len(set(names)) and all(tune.VARIANTS.values()), tune.VARIANTS
    assert all(name.startswith(prefixes[product]) for product, listed in tune.VARIANTS.items() for name in listed)
    empty = tmp_path / "CMakeLists.txt"
    empty.write_text("# no variants\n")
    with pytest.raises(RuntimeError, match="no set\\(variants"):
        tune.tuning_variants(empty)
