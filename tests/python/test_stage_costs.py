"""benchmarks/measure_stage_costs.py and benchmarks/predict_gpu_schedules.py at the tiny size on the
CPU: the measured costs are positive and shaped as the stages are, the bytes sent are the
activations', the schedule replays hold what the schedules should, the memory derived from the
per-action sizes matches the replays, and the predictions cover every schedule; the prediction's
arithmetic on hand-made costs (1F1B's known bubble, memory walked by hand)."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
LABELS = ["GPipe", "1F1B", "interleaved 1F1B", "ZB1P", "ZB-V", "DualPipeV"]


def bench(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("costs")
    measure = bench("measure_stage_costs")
    assert measure.main(["--device", "cpu", "--model", "tiny", "--ranks", "2", "--warmup", "0", "--repeats", "1",
                         "--replay-ranks", "2", "--replay-micro-batches", "4", "--quiet", "--out", str(out)]) == 0
    return out, json.loads((out / "stage_costs.json").read_text())


def test_measured_costs_are_positive_and_shaped_as_the_stages(measured):
    _, payload = measured
    entry = payload["models"]["tiny"]
    cfg = entry["config"]
    assert (cfg["dim"], cfg["layers"], cfg["context"], cfg["batch"], cfg["dtype"]) == (128, 4, 64, 4, "float32")
    assert entry["tokens_per_microbatch"] == 256
    assert sorted(entry["splits"]) == ["2", "4"]  # 2 ranks x 1 and 2 stages per rank
    assert entry["splits"]["2"]["pieces"] == [[0, 1, 2], [3, 4, 5]]  # embedding + 2 blocks, 2 blocks + head
    for count, split in entry["splits"].items():
        n = int(count)
        for key in ("forward_s", "backward_input_s", "backward_weight_s", "activation_bytes", "wgrad_stash_bytes",
                    "static_bytes"):
            assert len(split[key]) == n and all(v > 0 for v in split[key]), (count, key, split[key])
        for kind in "FIWB":
            assert len(split["transient_bytes"][kind]) == n and all(v >= 0 for v in split["transient_bytes"][kind])
        # a stage sends its activation (batch x context x dim, float32); the last sends nothing forward
        assert split["p2p_bytes"] == [4 * 64 * 128 * 4] * (n - 1) + [0]
        # the parameters of the stages are the model's, and the output layer's copy of the embedding
        assert sum(split["static_bytes"]) == 4 * (entry["parameters"] + cfg["vocab"] * cfg["dim"])
        # a micro-batch holds at least its received input from F to B, and its B leaves the stash
        for s in range(1, n):
            assert split["activation_bytes"][s] >= split["p2p_bytes"][0]


def test_replays_hold_what_the_schedules_hold(measured):
    _, payload = measured
    entry = payload["models"]["tiny"]
    replays = {r["schedule"]: r for r in entry["replays"]}
    assert sorted(replays) == sorted(["gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev"])
    for r in replays.values():
        assert r["ranks"] == 2 and r["micro_batches"] == 4 and len(r["peak_bytes"]) == 2
        assert all(p > 0 for p in r["peak_bytes"])
    act = entry["splits"]["2"]["activation_bytes"]
    # GPipe runs all 4 forwards before any backward: each rank holds 4 micro-batches
    assert all(peak >= 4 * a for peak, a in zip(replays["gpipe"]["peak_bytes"], act))
    # 1F1B's last rank holds one micro-batch at a time, so much less than GPipe's
    assert replays["1f1b"]["peak_bytes"][1] < 2 * act[1] < replays["gpipe"]["peak_bytes"][1]
    # ZB1P's last rank keeps W's stash after B: more than 1F1B's last rank holds
    assert replays["zb1p"]["peak_bytes"][1] > replays["1f1b"]["peak_bytes"][1]


def test_measure_prints_the_table(measured, capsys):
    out, _ = measured
    measure = bench("measure_stage_costs")
    capsys.readouterr()
    assert measure.main(["--device", "cpu", "--model", "tiny", "--ranks", "2", "--schedules", "1f1b", "--warmup",
                         "0", "--repeats", "1", "--replay-ranks", "--quiet", "--out", str(out / "again")]) == 0
    printed = capsys.readouterr().out
    assert "F:B:W" in printed and "act MiB" in printed and "tiny: dim 128" in printed
    assert "stage_costs.json" in printed


def test_predictions_cover_every_schedule_and_match_the_replays(measured, tmp_path):
    costs, _ = measured
    predict = bench("predict_gpu_schedules")
    assert predict.main(["--costs", str(costs / "stage_costs.json"), "--out", str(tmp_path), "--ranks", "2",
                         "--micro-batches", "4", "8"]) == 0
    text = (tmp_path / "predicted_schedules.md").read_text()
    for label in LABELS:
        assert f"| {label} | 2 | 4 |" in text and f"| {label} | 2 | 8 |" in text, label
    assert "Peak memory per rank" in text
    assert (tmp_path / "predicted_tiny_m4.png").read_bytes()[:8] == PNG
    rows = json.loads((tmp_path / "predicted_schedules.json").read_text())["rows"]
    assert len(rows) == 12
    for row in rows:
        assert row["step_s"] > 0 and 0 <= row["bubble"] < 1, row
        assert row["tokens_per_s"] == pytest.approx(256 * row["micro_batches"] / row["step_s"])
    # the memory derived from the per-action sizes against the replays' (the same 4 micro-batches)
    entry = json.loads((costs / "stage_costs.json").read_text())["models"]["tiny"]
    sim = predict.sim
    for replay in entry["replays"]:
        split = entry["splits"][str(2 * sim.SCHEDULES[replay["schedule"]][1])]
        derived = predict.memory_peaks(sim.schedule_actions(replay["schedule"], 2, 4), split)
        assert derived == pytest.approx(replay["peak_bytes"], rel=0.1), replay["schedule"]


def hand_costs(path):
    """2 and 4 stages of F = B = W = 1 ms, nothing sent; per stage 100 bytes of activation, 60 of
    stash, transients F 10, B 20, W 5; static 1000 bytes."""
    def split(n):
        return {"pieces": [[s] for s in range(n)], "forward_s": [1e-3] * n, "backward_input_s": [1e-3] * n,
                "backward_weight_s": [1e-3] * n, "p2p_bytes": [0] * n, "activation_bytes": [100] * n,
                "wgrad_stash_bytes": [60] * n, "static_bytes": [1000] * n,
                "transient_bytes": {"F": [10] * n, "I": [20] * n, "W": [5] * n, "B": [20] * n}}
    payload = {"date": "today", "device": "by hand", "torch": torch.__version__, "timing": "by hand", "repeats": 1,
               "models": {"hand": {"config": {"dim": 8, "heads": 1, "layers": 4, "context": 4, "batch": 1, "vocab": 8,
                                              "dtype": "float32"},
                                   "tokens_per_microbatch": 100, "parameters": 1, "replays": [],
                                   "splits": {"2": split(2), "4": split(4)}}}}
    path.write_text(json.dumps(payload))
    return path


def test_prediction_by_hand(tmp_path):
    predict = bench("predict_gpu_schedules")
    costs = hand_costs(tmp_path / "costs.json")
    assert predict.main(["--costs", str(costs), "--out", str(tmp_path), "--ranks", "2", "--micro-batches", "2", "8",
                         "--latency-us", "0"]) == 0
    rows = {(r["schedule"], r["micro_batches"]): r
            for r in json.loads((tmp_path / "predicted_schedules.json").read_text())["rows"]}
    one = rows[("1f1b", 8)]
    assert one["step_s"] == pytest.approx(3e-3 * 9)  # (m + p - 1)(F + B + W)
    assert one["bubble"] == pytest.approx(1 / 9)
    assert one["tokens_per_s"] == pytest.approx(800 / 27e-3)
    # 1F1B: rank 0 holds 2 micro-batches (200) and runs a full backward on top (+20); rank 1 one
    assert one["peak_bytes"] == [220, 120] and one["static_bytes"] == [1000, 1000]
    # GPipe: 8 micro-batches held (800), then the first backward's transient (+20)
    assert rows[("gpipe", 8)]["peak_bytes"] == [820, 820]
    # ZB1P, rank 0: F0 F1 I0 W0 ...: 200 held, I0's transient on top (220), then 160 until W0
    assert rows[("zb1p", 8)]["peak_bytes"][0] == 220
    # V schedules use the 4-stage costs and hold both of a rank's stages
    assert rows[("zbv", 8)]["stages"] == 4 and rows[("zbv", 8)]["static_bytes"] == [2000, 2000]
    # DualPipeV needs at least as many micro-batches as stages: not predicted with 2, and said why
    assert "skipped" in rows[("dualpipev", 2)]
    text = (tmp_path / "predicted_schedules.md").read_text()
    assert "| DualPipeV | 2 | 2 | – |" in text and "DualPipeV on 2 ranks with 2 micro-batches" in text
    assert "| 1F1B | 2 | 8 | 27.00 | 29,630 | 11.1% | 1.000× |" in text


def test_predict_refuses_bad_input(tmp_path, capsys):
    predict = bench("predict_gpu_schedules")
    with pytest.raises(SystemExit) as exit_info:
        predict.main(["--costs", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "run benchmarks/measure_stage_costs.py first" in capsys.readouterr().err
    costs = hand_costs(tmp_path / "costs.json")
    for args, message in ((["--schedules", "pipedream"], "unknown schedule 'pipedream'"),
                          (["--bandwidth-gbs", "0"], "--bandwidth-gbs must be > 0"),
                          (["--ranks", "1"], "--ranks must be >= 2")):
        with pytest.raises(SystemExit):
            predict.main(["--costs", str(costs), "--out", str(tmp_path), *args])
        assert message in capsys.readouterr().err


def test_measure_refuses_bad_input(tmp_path, capsys):
    measure = bench("measure_stage_costs")
    cases = [(["--schedules", "pipedream"], "unknown schedule 'pipedream'"),
             (["--repeats", "0"], "--repeats and --replay-micro-batches >= 1"),
             (["--model", "huge"], "invalid choice: 'huge'")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: no GPU is visible"))
    for args, message in cases:
        with pytest.raises(SystemExit):
            measure.main(["--device", "cpu", "--out", str(tmp_path), *args] if "--device" not in args
                         else ["--out", str(tmp_path), *args])
        assert message in capsys.readouterr().err, args


def test_bfloat16_stages_carry_fp32_main_grads(tmp_path):
    """As on a GPU: bf16 parameters with fused fp32 main_grads (6 bytes per parameter), bf16 activations
    sent, and the W steps add into main_grad."""
    measure = bench("measure_stage_costs")
    assert measure.main(["--device", "cpu", "--model", "tiny", "--dtype", "bfloat16", "--ranks", "2", "--schedules",
                         "zb1p", "--warmup", "0", "--repeats", "1", "--replay-ranks", "2",
                         "--replay-micro-batches", "2",
                         "--quiet", "--out", str(tmp_path)]) == 0
    entry = json.loads((tmp_path / "stage_costs.json").read_text())["models"]["tiny"]
    split = entry["splits"]["2"]
    assert entry["config"]["dtype"] == "bfloat16"
    cfg = entry["config"]
    assert sum(split["static_bytes"]) == 6 * (entry["parameters"] + cfg["vocab"] * cfg["dim"])
    assert split["p2p_bytes"] == [4 * 64 * 128 * 2, 0]
    assert all(v > 0 for v in split["forward_s"] + split["backward_weight_s"] + split["wgrad_stash_bytes"])
    assert [r["schedule"] for r in entry["replays"]] == ["zb1p"]
    assert all(p > 0 for p in entry["replays"][0]["peak_bytes"])


def test_a_model_of_your_own():
    """README's path for any model: stage modules wrapped in Stage, measured, simulated, replayed."""
    measure = bench("measure_stage_costs")
    from splitgrad import schedule_sim as sim
    import splitgrad
    from torch import nn

    torch.manual_seed(0)
    modules = [nn.Sequential(splitgrad.Linear(32, 32, device="cpu", delay_wgrad_compute=True), nn.GELU())
               for _ in range(2)]

    def receive():
        return torch.randn(16, 32, requires_grad=True)

    stages = [measure.Stage(m, s, 2, make_input=receive, loss_fn=lambda out: out.square().mean())
              for s, m in enumerate(modules)]
    c = measure.measure_split(stages, "cpu", warmup=0, repeats=2)
    assert c["p2p_bytes"] == [16 * 32 * 4, 0] and all(t > 0 for t in c["forward_s"] + c["backward_weight_s"])
    assert c["static_bytes"] == [4 * (32 * 32 + 32)] * 2
    costs = sim.Costs(c["forward_s"], c["backward_input_s"], c["backward_weight_s"], p2p_bytes=c["p2p_bytes"],
                      latency=10e-6, bandwidth=360e9, activation=c["activation_bytes"],
                      wgrad_stash=c["wgrad_stash_bytes"])
    r = sim.simulate("zb1p", ranks=2, micro_batches=4, costs=costs, tokens_per_microbatch=16)
    assert r.step_time > 0 and 0 <= r.bubble < 1
    peaks = measure.replay(stages, "zb1p", 2, 4)
    assert len(peaks) == 2 and all(p >= a for p, a in zip(peaks, c["activation_bytes"]))
    assert splitgrad.pending_wgrads() == 0


def test_a_failing_size_is_reported_and_the_others_kept(tmp_path, monkeypatch, capsys):
    """On the device every size runs in one call: one that fails must not lose the others."""
    measure = bench("measure_stage_costs")
    build = measure.build_model

    def failing(name, device, dtype):
        if name == "small":
            raise RuntimeError("no memory for small")
        return build(name, device, dtype)

    monkeypatch.setattr(measure, "build_model", failing)
    assert measure.main(["--device", "cpu", "--model", "small", "tiny", "--ranks", "2", "--schedules", "1f1b",
                         "--warmup", "0", "--repeats", "1", "--replay-ranks", "--quiet", "--out", str(tmp_path)]) == 1
    payload = json.loads((tmp_path / "stage_costs.json").read_text())
    assert list(payload["models"]) == ["tiny"] and "no memory for small" in payload["failed"]["small"]
    captured = capsys.readouterr()
    assert "FAILED: small" in captured.out and "small: FAILED" in captured.err
