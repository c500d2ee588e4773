"""splitgrad.schedule_sim: torch's own action lists replayed as a timeline.

Hand-checked small cases (1F1B and GPipe on 2 stages event by event, GPipe's (p-1)/(m+p-1), ZB-H1's
third of 1F1B's idle time, the rendezvous p2p model), every schedule's action list complete and
its replay honouring every dependency for 2, 4 and 8 ranks, cost scaling, memory counts and bad
input. CPU only, no processes.
"""

from __future__ import annotations

import itertools
import math

import pytest

import splitgrad
from splitgrad import ArgumentError
from splitgrad import schedule_sim as sim

ALL = list(sim.SCHEDULES)
RANKS = [2, 4, 8]
MICRO_BATCHES = [8, 16, 32]


def cases():
    """Every schedule, rank count and micro-batch count that torch accepts (DualPipeV needs at least
    as many micro-batches as stages)."""
    for name, ranks, m in itertools.product(ALL, RANKS, MICRO_BATCHES):
        if name == "dualpipev" and m < 2 * ranks:
            continue
        yield name, ranks, m


def unit(**kw):
    return sim.Costs(1.0, 1.0, 1.0, **kw)


def spans(result):
    return {(e.rank, e.stage, e.kind, e.microbatch): (e.start, e.end) for e in result.events}


def test_lazy_attribute():
    assert splitgrad.schedule_sim is sim


def test_1f1b_two_stages_event_by_event():
    # F = B = W = 1, a full backward 2; m = 2: rank 1 runs F0 B0 F1 B1 back to back from t = 1.
    r = sim.simulate("1f1b", 2, 2, unit())
    assert spans(r) == {
        (0, 0, "F", 0): (0, 1), (0, 0, "F", 1): (1, 2), (0, 0, "B", 0): (4, 6), (0, 0, "B", 1): (7, 9),
        (1, 1, "F", 0): (1, 2), (1, 1, "B", 0): (2, 4), (1, 1, "F", 1): (4, 5), (1, 1, "B", 1): (5, 7)}
    assert r.step_time == 9
    assert r.bubble == pytest.approx(1 / 3)
    assert r.peak_memory == [2, 1]


@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_1f1b_two_stages_known_bubble(m):
    # 1F1B on p stages idles (p - 1)(F + B + W) per rank: (p-1)/(m+p-1) of the step.
    r = sim.simulate("1f1b", 2, m, unit())
    assert r.step_time == pytest.approx(3 * (m + 1))
    assert r.bubble == pytest.approx(1 / (m + 1))


@pytest.mark.parametrize("ranks,m", list(itertools.product(RANKS, MICRO_BATCHES)))
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1.0, 2.0, 0.5)])
def test_gpipe_bubble(ranks, m, f, b, w):
    r = sim.simulate("gpipe", ranks, m, sim.Costs(f, b, w))
    assert r.step_time == pytest.approx((m + ranks - 1) * (f + b + w))
    assert r.bubble == pytest.approx((ranks - 1) / (m + ranks - 1))
    assert r.peak_memory == [m] * ranks  # every micro-batch's activation held until its backward


@pytest.mark.parametrize("ranks,m", list(itertools.product(RANKS, MICRO_BATCHES)))
def test_zb_h1_idles_a_third_of_1f1b(ranks, m):
    # ZB1P with one stage per rank follows ZB-H1: with F = B = W and free p2p its idle time is a
    # third of 1F1B's, (p - 1) against 3 (p - 1) per rank.
    idle = {}
    for name in ("1f1b", "zb1p"):
        r = sim.simulate(name, ranks, m, unit())
        idle[name] = ranks * r.step_time - sum(r.busy)
    assert idle["1f1b"] == pytest.approx(3 * ranks * (ranks - 1))
    assert idle["zb1p"] == pytest.approx(idle["1f1b"] / 3)


def test_1f1b_memory_per_rank():
    for ranks in RANKS:
        r = sim.simulate("1f1b", ranks, 16, unit())
        assert r.peak_memory == [ranks - rank for rank in range(ranks)]


def test_wgrad_stash_is_held_until_w():
    # ZB1P on 2 ranks: rank 0 runs F0 F1 I0 W0 ... With the whole activation kept for W it holds 2
    # micro-batches at most; when I frees all but a quarter, 1.25 (the two, minus what I0 freed).
    actions = sim.schedule_actions("zb1p", 2, 8)
    assert actions[0][:4] == [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "W", 0)]
    assert sim.simulate("zb1p", 2, 8, unit()).peak_memory[0] == 2
    held = sim.simulate("zb1p", 2, 8, unit(wgrad_stash=0.25)).peak_memory[0]
    running, peak = 0.0, 0.0
    for _, kind, _ in actions[0]:
        running += {"F": 1, "I": -0.75, "W": -0.25, "B": -1}[kind]
        peak = max(peak, running)
    assert held == pytest.approx(peak)
    assert sim.simulate("zb1p", 2, 8, unit(activation=3.0, wgrad_stash=3.0)).peak_memory[0] == 6


def test_1f1b_last_rank_starts_with_f0():
    # torch 2.11 numbers the last rank's forwards 1..m in Schedule1F1B.pipeline_order; its runtime
    # runs F0 B0 F1 B1 ... there, which is what is replayed.
    assert sim.schedule_actions("1f1b", 2, 4)[1] == [
        (1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1), (1, "F", 2), (1, "B", 2), (1, "F", 3), (1, "B", 3)]


@pytest.mark.parametrize("name,ranks,m", list(cases()))
def test_action_list_is_replayed_completely(name, ranks, m):
    actions = sim.schedule_actions(name, ranks, m)
    per_rank = sim.SCHEDULES[name][1]
    stages = ranks * per_rank
    counts = {}
    for rank, acts in enumerate(actions):
        for stage, kind, mb in acts:
            counts[(stage, kind, mb)] = counts.get((stage, kind, mb), 0) + 1
    for stage, mb in itertools.product(range(stages), range(m)):
        assert counts.pop((stage, "F", mb)) == 1
        if (stage, "B", mb) in counts:
            assert counts.pop((stage, "B", mb)) == 1
        else:
            assert counts.pop((stage, "I", mb)) == 1 and counts.pop((stage, "W", mb)) == 1
    assert not counts
    r = sim.simulate(name, ranks, m, unit())
    assert len(r.events) == sum(len(a) for a in actions)
    for rank, acts in enumerate(actions):  # each rank replays its list in torch's order
        mine = sorted((e for e in r.events if e.rank == rank), key=lambda e: e.start)
        assert [(e.stage, e.kind, e.microbatch) for e in mine] == acts
    if name in ("zb1p", "interleaved-zb", "zbv"):
        assert all(kind in "FIW" for acts in actions for _, kind, _ in acts)
    if name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert all(kind in "FB" for acts in actions for _, kind, _ in acts)


@pytest.mark.parametrize("name,ranks,m", [c for c in cases() if c[2] in (8, 16)])
@pytest.mark.parametrize("rendezvous", [False, True])
def test_dependencies_respected(name, ranks, m, rendezvous):
    stages = ranks * sim.SCHEDULES[name][1]
    f = [1.0 + 0.1 * s for s in range(stages)]
    b = [1.5 - 0.05 * s for s in range(stages)]
    w = [0.4 + 0.02 * s for s in range(stages)]
    nbytes = [1000.0 * (s + 1) for s in range(stages)]
    costs = sim.Costs(f, b, w, p2p_bytes=nbytes, latency=0.3, bandwidth=1e4, action_overhead=0.05,
                      rendezvous=rendezvous)
    r = sim.simulate(name, ranks, m, costs)
    done = {}
    rank_of = {}
    for e in r.events:
        rank_of[e.stage] = e.rank
        done[(e.stage, "I" if e.kind == "B" else e.kind, e.microbatch)] = e
        if e.kind == "B":
            done[(e.stage, "W", e.microbatch)] = e

    def p2p(src, dst, size):
        return 0.0 if rank_of[src] == rank_of[dst] else 0.3 + size / 1e4

    eps = 1e-9
    for e in r.events:
        s, mb = e.stage, e.microbatch
        length = {"F": f[s], "I": b[s], "W": w[s], "B": b[s] + w[s]}[e.kind]
        assert e.end - e.start == pytest.approx(length)
        if e.kind == "F" and s > 0:
            assert e.start >= done[(s - 1, "F", mb)].end + p2p(s - 1, s, nbytes[s - 1]) - eps
        if e.kind in ("I", "B"):
            assert e.start >= done[(s, "F", mb)].end - eps
            if s < stages - 1:
                assert e.start >= done[(s + 1, "I", mb)].end + p2p(s + 1, s, nbytes[s]) - eps
        if e.kind == "W":
            assert e.start >= done[(s, "I", mb)].end - eps
    for rank in range(ranks):  # one action at a time, with the host overhead between
        mine = sorted((e for e in r.events if e.rank == rank), key=lambda e: e.start)
        for a, z in zip(mine, mine[1:]):
            assert z.start >= a.end + 0.05 - eps
    assert r.step_time == pytest.approx(max(e.end for e in r.events))
    assert r.bubble == pytest.approx(1 - sum(r.busy) / (ranks * r.step_time))
    assert 0 <= r.bubble < 1


def test_gpipe_rendezvous_by_hand():
    # p = 2, m = 2, F = B = W = 1, latency 0.5. Eager: a tensor moves as soon as it is sent.
    # Rendezvous: also no earlier than the receiver posts its receive, right before its action.
    eager = sim.simulate("gpipe", 2, 2, unit(latency=0.5))
    assert spans(eager)[(1, 1, "F", 1)] == (2.5, 3.5)
    assert spans(eager)[(0, 0, "B", 1)] == (8.0, 10.0)
    assert eager.step_time == 10
    rdv = sim.simulate("gpipe", 2, 2, unit(latency=0.5, rendezvous=True))
    assert spans(rdv)[(1, 1, "F", 0)] == (1.5, 2.5)
    assert spans(rdv)[(1, 1, "F", 1)] == (3.0, 4.0)  # posted at 2.5, sent at 2: moves from 2.5
    assert spans(rdv)[(0, 0, "B", 0)] == (6.5, 8.5)
    assert spans(rdv)[(0, 0, "B", 1)] == (9.0, 11.0)
    assert rdv.step_time == 11


@pytest.mark.parametrize("name", ALL)
def test_costs_scale(name):
    base = sim.Costs([1.0, 2.0, 1.5, 1.0] if sim.SCHEDULES[name][1] == 2 else [1.0, 2.0], 1.2, 0.7,
                     p2p_bytes=64.0, latency=0.2, bandwidth=320.0, action_overhead=0.01, step_overhead=0.3)
    r1 = sim.simulate(name, 2, 8, base, tokens_per_microbatch=256)
    k = 3.0
    scaled = sim.Costs([k * x for x in base.forward], k * base.backward_input, k * base.backward_weight,
                       p2p_bytes=64.0, latency=k * 0.2, bandwidth=320.0 / k, action_overhead=k * 0.01,
                       step_overhead=k * 0.3)
    r3 = sim.simulate(name, 2, 8, scaled, tokens_per_microbatch=256)
    assert r3.step_time == pytest.approx(k * r1.step_time)
    assert r3.bubble == pytest.approx(r1.bubble)
    assert r1.tokens_per_s == pytest.approx(256 * 8 / r1.step_time)
    assert r3.tokens_per_s == pytest.approx(r1.tokens_per_s / k)
    # more work per stage never shortens the step; the step overhead adds to it one to one
    slower = sim.simulate(name, 2, 8, sim.Costs(base.forward, 1.2, 1.4, p2p_bytes=64.0, latency=0.2,
                                                bandwidth=320.0, action_overhead=0.01, step_overhead=0.3))
    assert slower.step_time > r1.step_time
    no_overhead = sim.simulate(name, 2, 8, sim.Costs(base.forward, 1.2, 0.7, p2p_bytes=64.0, latency=0.2,
                                                     bandwidth=320.0, action_overhead=0.01))
    assert r1.step_time - no_overhead.step_time == pytest.approx(0.3)


def test_plot_timeline(tmp_path):
    results = [sim.simulate(n, 2, 8, unit()) for n in ("1f1b", "zb1p", "dualpipev")]
    path = tmp_path / "timeline.png"
    sim.plot_timeline(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ArgumentError, match="no results"):
        sim.plot_timeline([], str(path))


def test_cli(capsys, tmp_path):
    assert sim._main(["--ranks", "2", "--micro-batches", "8", "--forward", "2", "--backward-input", "2",
                      "--backward-weight", "2", "--schedules", "1f1b,zb1p", "--png", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "1F1B" in out and "ZB1P" in out and "11.1%" in out and "4.0%" in out
    assert (tmp_path / "t.png").exists()


@pytest.mark.parametrize("call,match", [
    (lambda: sim.simulate("pipedream", 2, 8, unit()), "unknown schedule 'pipedream'"),
    (lambda: sim.simulate("1f1b", 1, 8, unit()), "ranks to be an integer >= 2, got 1"),
    (lambda: sim.simulate("1f1b", 2, 0, unit()), "micro_batches to be an integer >= 1, got 0"),
    (lambda: sim.simulate("1f1b", 2.0, 8, unit()), "ranks to be an integer"),
    (lambda: sim.simulate("1f1b", 2, 8, sim.Costs(-1.0, 1.0, 1.0)), "forward to be finite and >= 0, got -1.0"),
    (lambda: sim.simulate("1f1b", 2, 8, sim.Costs(math.nan, 1.0, 1.0)), "forward to be finite"),
    (lambda: sim.simulate("1f1b", 2, 8, sim.Costs([1.0, 1.0, 1.0], 1.0, 1.0)),
     "forward as one number or 2 \\(one per stage\\), got 3"),
    (lambda: sim.simulate("zbv", 2, 8, sim.Costs([1.0, 1.0], 1.0, 1.0)), "one number or 4"),
    (lambda: sim.simulate("1f1b", 2, 8, unit(bandwidth=0)), "bandwidth > 0"),
    (lambda: sim.simulate("1f1b", 2, 8, unit(latency=-1)), "latency to be finite and >= 0"),
    (lambda: sim.simulate("1f1b", 2, 8, {"forward": 1}), "expected costs to be a schedule_sim.Costs, got dict"),
    (lambda: sim.simulate("1f1b", 2, 8, unit(), tokens_per_microbatch=0), "tokens_per_microbatch"),
    (lambda: sim.simulate("dualpipev", 8, 8, unit()), "ScheduleDualPipeV refuses 8 ranks x 2 stages with 8"),
])
def test_bad_input(call, match):
    with pytest.raises(ArgumentError, match=match):
        call()


@pytest.mark.parametrize("name", ALL)
def test_shared_cores(name):
    # One processor for all ranks: the actions run one at a time, so the step is all the work and
    # the bubble 1 - 1/ranks; with a processor per rank nothing changes.
    alone = sim.simulate(name, 4, 8, unit(cores=1))
    assert alone.step_time == pytest.approx(sum(alone.busy))
    assert alone.bubble == pytest.approx(0.75)
    ordered = sorted(alone.events, key=lambda e: e.start)
    assert all(z.start >= a.end - 1e-9 for a, z in zip(ordered, ordered[1:]))
    assert spans(sim.simulate(name, 4, 8, unit(cores=4))) == spans(sim.simulate(name, 4, 8, unit()))
    two = sim.simulate(name, 4, 8, unit(cores=2))
    assert two.bubble >= 0.5 - 1e-9  # at most two of four ranks busy at any time
    with pytest.raises(ArgumentError, match="cores to be an integer >= 1, got 0"):
        sim.simulate(name, 4, 8, unit(cores=0))
