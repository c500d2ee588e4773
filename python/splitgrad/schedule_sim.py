"""Predicts a pipeline schedule's step time, bubble and stash memory from per-stage F / B / W costs.

The actions are torch's own: each schedule class of ``torch.distributed.pipelining`` is built on
stand-in stages (as torch's ``_schedule_visualizer.get_schedule_ops`` does) and its
``pipeline_order`` — per rank, the compute actions in the order the rank runs them — is replayed as a
discrete-event timeline. Nothing here re-implements a schedule.

The model (:func:`simulate`):

- **Durations.** ``F`` takes ``forward[s]``, ``I`` (torch's BACKWARD_INPUT: our B step, input
  gradients only) ``backward_input[s]``, ``W`` ``backward_weight[s]``, and a ``FULL_BACKWARD``
  (GPipe, 1F1B, interleaved 1F1B, some of DualPipeV's) ``backward_input[s] + backward_weight[s]``,
  all in seconds per micro-batch of stage ``s``. An ``OVERLAP_F_B`` pair (DualPipeV) runs its two
  actions one after the other, as torch's runtime does.
- **Order.** Each rank runs its actions in torch's order, one at a time; before each it spends
  ``action_overhead`` seconds idle (host work between actions: Python, the schedule's bookkeeping,
  posting sends and receives).
- **Dependencies.** ``F`` of stage ``s`` waits for ``F`` of stage ``s - 1`` of the same micro-batch;
  ``B``/``I`` of stage ``s`` for ``B``/``I`` of stage ``s + 1`` (and its own ``F``); ``W`` for its
  ``I``. Between stages on different ranks the tensor travels ``latency + bytes / bandwidth``
  (``p2p_bytes[s]``: what stage ``s`` sends forward per micro-batch; its gradient, sent back, has
  the same size); between stages on one rank (V schedules) it costs nothing. Transfers overlap
  compute (torch posts them asynchronously) and links never congest. With ``rendezvous=True`` a
  transfer starts only once the receiver has posted its receive, at the place torch's lowering
  (``pipeline_order_with_comms``; for GPipe and 1F1B, right before the action) puts it, as a gloo
  send waits for the matching receive. With ``cores=n`` the ranks share n processors (processes
  on a CPU with fewer cores than ranks): an action runs whole on one, the first ready first.
- **Step.** The step time is the span from the first action's start to the last one's end, plus
  ``step_overhead`` (the step's fixed host work: splitting the batch, the final waits).
- **Bubble.** ``1 - Σ_r busy_r / (ranks · step time)``, the definition of
  :func:`splitgrad.pipelining.bubble_fraction` (busy: time in F, B, I or W).
- **Memory.** In activation units, per rank, counted along the rank's order (timing does not change
  it): ``F`` adds ``activation[s]`` (the stage's autograd stash for one micro-batch); a full ``B``
  releases it; ``I`` releases it but keeps ``wgrad_stash[s]`` — what the deferred W step needs (the
  inputs and output gradients of the stage's delayed layers) — until ``W`` releases that. The
  default ``wgrad_stash = activation`` counts a micro-batch as held from its F to its W.
  Parameters, gradients and optimizer state are not counted.

:func:`plot_timeline` draws a result as a PNG; ``python -m splitgrad.schedule_sim`` prints a table.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Sequence
from unittest import mock

from torch.distributed import pipelining as _pipelining
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.stage import PipelineStage as _TorchPipelineStage

from ._errors import ArgumentError

__all__ = ["SCHEDULES", "Costs", "Event", "Result", "schedule_actions", "simulate", "plot_timeline"]

#: name -> (torch schedule class, stages per rank, label). The names are examples/demo.py's.
SCHEDULES = {
    "gpipe": (_pipelining.ScheduleGPipe, 1, "GPipe"),
    "1f1b": (_pipelining.Schedule1F1B, 1, "1F1B"),
    "interleaved-1f1b": (_pipelining.ScheduleInterleaved1F1B, 2, "interleaved 1F1B"),
    "zb1p": (_pipelining.ScheduleInterleavedZeroBubble, 1, "ZB1P"),
    "interleaved-zb": (_pipelining.ScheduleInterleavedZeroBubble, 2, "interleaved ZB1P"),
    "zbv": (_pipelining.ScheduleZBVZeroBubble, 2, "ZB-V"),
    "dualpipev": (_pipelining.ScheduleDualPipeV, 2, "DualPipeV"),
}

_F = _schedules._ComputationType.FORWARD
_I = _schedules._ComputationType.BACKWARD_INPUT
_W = _schedules._ComputationType.BACKWARD_WEIGHT
_B = _schedules._ComputationType.FULL_BACKWARD
_OVERLAP = _schedules._ComputationType.OVERLAP_F_B
_KIND = {_F: "F", _I: "I", _W: "W", _B: "B"}


def _schedule_entry(name: str):
    if name not in SCHEDULES:
        raise ArgumentError(f"schedule_sim: unknown schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


def _check_count(what: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(f"schedule_sim: expected {what} to be an integer >= {least}, got {value!r}")
    return value


def _torch_schedule(cls, ranks: int, micro_batches: int, stages_per_rank: int):
    """The schedule built the way torch's _schedule_visualizer does it, on a stand-in stage: the
    schedule classes compute every rank's order up front. (Its get_schedule_ops refuses a
    multi-stage class with one stage per rank, which ZB1P is.)"""
    stage = mock.create_autospec(_TorchPipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = ranks
    stage.submod = None
    stage.num_stages = ranks * stages_per_rank
    stages = stage if issubclass(cls, _schedules.PipelineScheduleSingle) else [stage] * stages_per_rank
    try:
        schedule = cls(stages, micro_batches)
    except (ValueError, AssertionError, RuntimeError) as error:
        raise ArgumentError(f"schedule_sim: torch's {cls.__name__} refuses {ranks} ranks x "
                            f"{stages_per_rank} stages with {micro_batches} micro-batches: {error}") from error
    if schedule.pipeline_order is None:
        raise ArgumentError(f"schedule_sim: torch's {cls.__name__} has no pipeline_order to replay")
    return schedule


def _repair_1f1b_last_rank(actions: list) -> list:
    """torch 2.11's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m instead of
    0..m-1 (it increments its counter before the first forward where there is no warm-up); its
    runtime (``_step_microbatches``) runs F0 first there. Shift them back only where that is what came."""
    forwards = [a.microbatch_index for a in actions if a.computation_type == _F]
    if forwards != list(range(1, len(forwards) + 1)):
        return actions
    return [a._replace(microbatch_index=a.microbatch_index - 1) if a.computation_type == _F else a
            for a in actions]


def _flatten(actions) -> list:
    """Compute actions only (no None, comms, REDUCE_GRAD); an OVERLAP_F_B pair as its two actions."""
    flat = []
    for action in actions:
        if action is None:
            continue
        subs = action.sub_actions if action.computation_type == _OVERLAP else (action,)
        flat.extend(a for a in subs if a.computation_type in _KIND)
    return flat


def _plan(name: str, ranks: int, micro_batches: int):
    """Torch's compute actions per rank, and where each receive is posted: ``(stage, "F"|"B", mb)``
    -> the index of the rank's compute action after which torch posts that receive (-1: before
    the first). Multi-stage schedules take it from torch's lowering with comms
    (``pipeline_order_with_comms``); GPipe and 1F1B post each receive right before its action."""
    cls, per_rank, _ = _schedule_entry(name)
    _check_count("ranks", ranks, 2)
    _check_count("micro_batches", micro_batches, 1)
    schedule = _torch_schedule(cls, ranks, micro_batches, per_rank)
    actions, posts = [], {}
    for rank in range(ranks):
        flat = _flatten(schedule.pipeline_order.get(rank, []))
        if cls is _pipelining.Schedule1F1B:
            flat = _repair_1f1b_last_rank(flat)
        actions.append([(a.stage_index, _KIND[a.computation_type], a.microbatch_index) for a in flat])
        with_comms = getattr(schedule, "pipeline_order_with_comms", None)
        if with_comms is None:
            for i, (stage, kind, mb) in enumerate(actions[-1]):
                if kind != "W":
                    posts[(stage, "F" if kind == "F" else "B", mb)] = i - 1
            continue
        done = 0
        for action in with_comms.get(rank, []):
            if action.computation_type in (_schedules.RECV_F, _schedules.RECV_B):
                kind = "F" if action.computation_type == _schedules.RECV_F else "B"
                posts[(action.stage_index, kind, action.microbatch_index)] = done - 1
            else:
                done += len(_flatten([action]))
    _check_complete(name, actions, ranks * per_rank, micro_batches)
    return actions, posts


def schedule_actions(name: str, ranks: int, micro_batches: int) -> list[list[tuple[int, str, int]]]:
    """Torch's compute actions of schedule ``name`` on ``ranks`` ranks: per rank, in its order, the
    ``(stage, kind, micro-batch)`` of each action, ``kind`` one of ``"F"``, ``"I"`` (input
    gradients), ``"W"`` (weight gradients), ``"B"`` (full backward). An OVERLAP_F_B pair becomes its
    two actions in order. Checked complete: each stage runs on one rank, and each micro-batch's F
    once and either one B or one I and one W, per stage."""
    return _plan(name, ranks, micro_batches)[0]


def _check_complete(name: str, actions, num_stages: int, micro_batches: int) -> None:
    owner: dict[int, int] = {}
    seen: dict[tuple[int, str, int], int] = {}
    for rank, rank_actions in enumerate(actions):
        for stage, kind, mb in rank_actions:
            if owner.setdefault(stage, rank) != rank:
                raise ArgumentError(f"schedule_sim: {name}: stage {stage} has actions on ranks "
                                    f"{owner[stage]} and {rank}")
            seen[(stage, kind, mb)] = seen.get((stage, kind, mb), 0) + 1
    problems = []
    for stage in range(num_stages):
        for mb in range(micro_batches):
            count = {k: seen.pop((stage, k, mb), 0) for k in "FIWB"}
            if count["F"] != 1 or not (count["B"] == 1 and count["I"] == count["W"] == 0
                                       or count["B"] == 0 and count["I"] == count["W"] == 1):
                problems.append(f"stage {stage} micro-batch {mb}: {count}")
    problems += [f"unexpected action {key}" for key in seen]
    if problems:
        raise ArgumentError(f"schedule_sim: torch's {name} action list is incomplete for {num_stages} "
                            f"stages x {micro_batches} micro-batches: " + "; ".join(problems[:5]))


def _per_stage(what: str, value, num_stages: int, *, allow_zero: bool = True) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_stages
    if len(values) != num_stages:
        raise ArgumentError(f"schedule_sim: expected {what} as one number or {num_stages} (one per stage), "
                            f"got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (v == 0 and not allow_zero):
            raise ArgumentError(f"schedule_sim: expected {what} to be finite and "
                                f"{'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return [float(v) for v in values]


@dataclass
class Costs:
    """Per-micro-batch costs: a number for every stage or a list with one per stage (seconds, bytes).

    ``backward_input`` is the B step (input gradients), ``backward_weight`` the W step; a schedule's
    full backward costs their sum. ``p2p_bytes`` is what a stage sends forward per micro-batch (its
    activation; the gradient sent back has the same size), moved in ``latency + bytes / bandwidth``
    seconds; with ``rendezvous`` a transfer starts only once the receiver has also posted its
    receive, where torch's lowering puts it (a gloo send waits for the matching receive), without
    it when the sender is done. ``cores`` (None: every rank its own device) makes the ranks share
    that many processors: an action runs whole on one, the first ready first (ranks as processes on
    a CPU with fewer cores). ``action_overhead`` is idle host time before each action, ``step_overhead`` the fixed
    host time per step. ``activation`` and ``wgrad_stash`` are the memory units (see the module doc).
    """

    forward: float | Sequence[float]
    backward_input: float | Sequence[float]
    backward_weight: float | Sequence[float]
    p2p_bytes: float | Sequence[float] = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    rendezvous: bool = False
    cores: int | None = None
    action_overhead: float = 0.0
    step_overhead: float = 0.0
    activation: float | Sequence[float] = 1.0
    wgrad_stash: float | Sequence[float] | None = None  # None: equal to activation

    def resolved(self, num_stages: int) -> dict:
        out = {k: _per_stage(k, getattr(self, k), num_stages)
               for k in ("forward", "backward_input", "backward_weight", "p2p_bytes", "activation")}
        out["wgrad_stash"] = (list(out["activation"]) if self.wgrad_stash is None
                              else _per_stage("wgrad_stash", self.wgrad_stash, num_stages))
        for k in ("latency", "action_overhead", "step_overhead"):
            out[k] = _per_stage(k, getattr(self, k), 1)[0]
        if not isinstance(self.bandwidth, (int, float)) or isinstance(self.bandwidth, bool) \
                or math.isnan(self.bandwidth) or self.bandwidth <= 0:
            raise ArgumentError(f"schedule_sim: expected bandwidth > 0 (bytes/s), got {self.bandwidth!r}")
        out["bandwidth"] = float(self.bandwidth)
        if self.cores is not None:
            _check_count("cores", self.cores, 1)
        return out


@dataclass(frozen=True)
class Event:
    """One simulated action: times in seconds from the step's first action."""

    rank: int
    stage: int
    kind: str  # "F", "I", "W" or "B" (full backward)
    microbatch: int
    start: float
    end: float


@dataclass
class Result:
    schedule: str
    ranks: int
    num_stages: int
    micro_batches: int
    step_time: float  # seconds
    bubble: float
    busy: list[float]  # seconds per rank
    peak_memory: list[float]  # activation units per rank
    events: list[Event] = field(repr=False)
    tokens_per_s: float | None = None

    @property
    def label(self) -> str:
        return SCHEDULES[self.schedule][2]


def simulate(name: str, ranks: int, micro_batches: int, costs: Costs,
             tokens_per_microbatch: int | None = None) -> Result:
    """Replays torch's action list of schedule ``name`` (a key of :data:`SCHEDULES`) on ``ranks``
    ranks with ``micro_batches`` micro-batches and the given per-stage :class:`Costs`."""
    if not isinstance(costs, Costs):
        raise ArgumentError(f"schedule_sim: expected costs to be a schedule_sim.Costs, got {type(costs).__name__}")
    actions, posts = _plan(name, ranks, micro_batches)
    num_stages = ranks * SCHEDULES[name][1]
    c = costs.resolved(num_stages)
    rank_of = {stage: rank for rank, acts in enumerate(actions) for stage, _, _ in acts}

    def transfer(src: int, dst: int, nbytes: float) -> float:
        if rank_of[src] == rank_of[dst]:
            return 0.0
        return c["latency"] + nbytes / c["bandwidth"]

    def duration(stage: int, kind: str) -> float:
        return {"F": c["forward"][stage], "I": c["backward_input"][stage], "W": c["backward_weight"][stage],
                "B": c["backward_input"][stage] + c["backward_weight"][stage]}[kind]

    end: dict[tuple[int, str, int], float] = {}  # (stage, "F"|"I"|"W", mb) -> end time; B sets I and W

    def ready(rank: int, index: int, stage: int, kind: str, mb: int) -> float | None:
        """When the action's inputs are there, or None while a producer has not run yet."""
        needs: list[tuple[tuple[int, str, int], float, float]] = []  # producer, delay, not before
        if kind == "F" and stage > 0:
            needs.append(((stage - 1, "F", mb), transfer(stage - 1, stage, c["p2p_bytes"][stage - 1]),
                          posted(rank, index, (stage, "F", mb), stage - 1)))
        if kind in ("I", "B"):
            needs.append(((stage, "F", mb), 0.0, 0.0))
            if stage < num_stages - 1:
                needs.append(((stage + 1, "I", mb), transfer(stage + 1, stage, c["p2p_bytes"][stage]),
                              posted(rank, index, (stage, "B", mb), stage + 1)))
        if kind == "W":
            needs.append(((stage, "I", mb), 0.0, 0.0))
        t = 0.0
        for key, delay, not_before in needs:
            if key not in end:
                return None
            t = max(t, max(end[key], not_before) + delay)
        return t

    def posted(rank: int, index: int, recv: tuple[int, str, int], source: int) -> float:
        """When the receive was posted (rendezvous transfers start no earlier); 0 otherwise."""
        if not costs.rendezvous or rank_of[source] == rank:
            return 0.0
        after = min(posts.get(recv, index - 1), index - 1)
        return finished[rank][after] if after >= 0 else 0.0

    position = [0] * ranks
    free = [0.0] * ranks
    finished: list[list[float]] = [[] for _ in range(ranks)]  # end time of each rank's actions so far
    core_free = [0.0] * (costs.cores or 0)  # when each shared processor is next free
    events: list[Event] = []
    for _ in range(sum(len(a) for a in actions)):
        # Time order: start the action that can start first (a later one never starts before it).
        best = None
        for rank in range(ranks):
            if position[rank] < len(actions[rank]):
                stage, kind, mb = actions[rank][position[rank]]
                t = ready(rank, position[rank], stage, kind, mb)
                if t is not None and (best is None or max(free[rank] + c["action_overhead"], t) < best[0]):
                    best = (max(free[rank] + c["action_overhead"], t), rank)
        if best is None:  # pragma: no cover - torch's orders are deadlock-free; guards a bad one
            stuck = {r: actions[r][position[r]] for r in range(ranks) if position[r] < len(actions[r])}
            raise RuntimeError(f"schedule_sim: {name} deadlocks: every rank waits ({stuck})")
        start, rank = best
        stage, kind, mb = actions[rank][position[rank]]
        if core_free:
            core = min(range(len(core_free)), key=core_free.__getitem__)
            start = max(start, core_free[core])
        finish = start + duration(stage, kind)
        if core_free:
            core_free[core] = finish
        if kind == "B":
            end[(stage, "I", mb)] = end[(stage, "W", mb)] = finish
        else:
            end[(stage, kind, mb)] = finish
        events.append(Event(rank, stage, kind, mb, start, finish))
        free[rank] = finish
        finished[rank].append(finish)
        position[rank] += 1

    first = min(e.start for e in events)
    span = max(e.end for e in events) - first
    events = [Event(e.rank, e.stage, e.kind, e.microbatch, e.start - first, e.end - first) for e in events]
    step_time = span + c["step_overhead"]
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in range(ranks)]
    bubble = 1.0 - sum(busy) / (ranks * step_time) if step_time > 0 else 0.0

    peaks = []
    for rank_actions in actions:
        held = peak = 0.0
        for stage, kind, _ in rank_actions:
            act, stash = c["activation"][stage], c["wgrad_stash"][stage]
            held += {"F": act, "B": -act, "I": stash - act, "W": -stash}[kind]
            peak = max(peak, held)
        peaks.append(peak)
    if tokens_per_microbatch is not None:
        _check_count("tokens_per_microbatch", tokens_per_microbatch, 1)
    tokens = (tokens_per_microbatch * micro_batches / step_time
              if tokens_per_microbatch is not None and step_time > 0 else None)
    return Result(name, ranks, num_stages, micro_batches, step_time, bubble, busy, peaks, events, tokens)


_COLOURS = {"F": "#4c72b0", "I": "#55a868", "B": "#8172b3", "W": "#dd8452"}


def plot_timeline(results: Result | Sequence[Result], path: str, unit: str = "ms") -> None:
    """Draws each result's timeline (one row per rank) into the PNG ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [results] if isinstance(results, Result) else list(results)
    if not results:
        raise ArgumentError("schedule_sim.plot_timeline: no results to draw")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "1": 1.0}[unit]
    rows = sum(r.ranks for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.0 + 0.45 * rows + 0.5 * len(results)),
                             squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        for e in result.events:
            ax.broken_barh([(scale * e.start, scale * (e.end - e.start))], (e.rank - 0.4, 0.8),
                           facecolors=_COLOURS[e.kind], edgecolor="white", linewidth=0.3)
            if result.micro_batches <= 16:
                ax.text(scale * (e.start + e.end) / 2, e.rank, str(e.microbatch), ha="center", va="center",
                        fontsize=5, color="white")
        ax.set_yticks(range(result.ranks), [f"rank {r}" for r in range(result.ranks)])
        ax.invert_yaxis()
        ax.set_title(f"{result.label}, {result.ranks} ranks, {result.micro_batches} micro-batches: "
                     f"step {scale * result.step_time:.4g} {unit}, bubble {result.bubble:.1%}, "
                     f"peak stash {max(result.peak_memory):.3g}", fontsize=8)
        ax.set_xlabel(unit if unit != "1" else "time")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    fig.legend(handles, ["F", "B (input grad)", "full backward (B+W)", "W (weight grad)"], loc="upper right",
               fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitgrad.schedule_sim",
        description="Predicted step time, tokens/s, bubble and peak stash memory of torch's pipeline "
                    "schedules from the whole model's F/B/W costs per micro-batch, split evenly over the "
                    "stages. Peak stash: micro-batches' activations of one rank's share of the model "
                    "held at once (a W's stash counted as the whole activation), on the fullest rank.")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--forward", type=float, required=True, help="ms per micro-batch, whole model")
    parser.add_argument("--backward-input", type=float, required=True, help="ms, whole model")
    parser.add_argument("--backward-weight", type=float, required=True, help="ms, whole model")
    parser.add_argument("--p2p-bytes", type=float, default=0.0, help="bytes a stage sends per micro-batch")
    parser.add_argument("--latency-us", type=float, default=0.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=math.inf, help="GB/s per link")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--png", default=None, help="draw the first rank count / micro-batch count here")
    args = parser.parse_args(argv)
    print(f"{'schedule':>17} | {'ranks':>5} | {'mb':>3} | {'step (ms)':>9} | {'tokens/s':>9} | "
          f"{'bubble':>6} | {'peak stash':>10}")
    drawn = []
    for ranks in args.ranks:
        for m in args.micro_batches:
            for name in args.schedules.split(","):
                per_rank = _schedule_entry(name)[1]
                stages = ranks * per_rank
                # memory unit: one micro-batch's activations of a rank's share of the model
                costs = Costs(args.forward / 1e3 / stages, args.backward_input / 1e3 / stages,
                              args.backward_weight / 1e3 / stages, args.p2p_bytes, args.latency_us / 1e6,
                              args.bandwidth_gbs * 1e9, activation=1.0 / per_rank)
                try:
                    r = simulate(name, ranks, m, costs, args.tokens)
                except ArgumentError as error:
                    print(f"{SCHEDULES[name][2]:>17} | {ranks:>5} | {m:>3} | not run: {error}")
                    continue
                tps = f"{r.tokens_per_s:>9.0f}" if r.tokens_per_s is not None else f"{'-':>9}"
                print(f"{r.label:>17} | {ranks:>5} | {m:>3} | {1e3 * r.step_time:>9.3f} | {tps} | "
                      f"{r.bubble:>6.1%} | {max(r.peak_memory):>10.3g}")
                if ranks == args.ranks[0] and m == args.micro_batches[0]:
                    drawn.append(r)
    if args.png and drawn:
        plot_timeline(drawn, args.png)
        print(f"timeline: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
