"""Checks splitgrad.schedule_sim against real pipeline runs: the main job's GPT (examples/tinygpt.py)
trained with splitgrad.pipelining.PipelineStage on 2 and 4 gloo processes on the CPU, under each of
torch's schedules, with a StageTimeline on every stage (as examples/demo.py measures).

From each run it takes
  - the median F, B (input gradients) and W time of every stage (a full backward's B minus the W
    nested in it), over the steps after the first;
  - the host costs the simulator models (fitted once per process count, over all its schedules):
    the idle gap before an action whose input was already there (``action_overhead``), the delay
    between a producer's end and a waiting consumer's start on another rank (``latency``: gloo's
    send/recv plus the wake-up; bytes are in it, so ``bandwidth`` is infinite), and the step's time
    outside its actions (``step_overhead``);
  - the measured median step time and bubble (splitgrad.pipelining.bubble_fraction over the step's
    window).
It prints, per schedule, the measured figures next to two predictions: from the F/B/W costs alone,
and with the fitted host costs; and whether each rank ran its actions in the order of torch's
action list that the simulator replays.

    PYTHONPATH=$SPLITGRAD_SITE python benchmarks/validate_schedule_sim.py [--ranks 2 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import splitgrad.pipelining as sgp
from splitgrad import schedule_sim as sim

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import demo  # noqa: E402  (examples/demo.py: the main job's delayed splitgrad modules)
import tinygpt  # noqa: E402  (examples/tinygpt.py)

V_SCHEDULES = ("zbv", "dualpipev")


def run_schedule(rank, world, name, args, data, vocab):
    """``args.steps`` steps of schedule ``name``; this rank's intervals and step windows per step."""
    cls, per_rank, _ = sim.SCHEDULES[name]
    num_stages = world * per_rank
    mine = sgp.stages_of_rank(rank, world, per_rank, "v" if name in V_SCHEDULES else "loop")

    pieces = tinygpt.build_pieces(demo.delayed_layers(torch.device("cpu"), torch.float32), vocab=vocab, dim=args.dim, heads=args.heads,
                                  layers=args.layers, context=args.context, seed=0)
    modules = {s: tinygpt.stage_module(pieces, s, num_stages) for s in mine}
    stages = [sgp.PipelineStage(modules[s], s, num_stages, "cpu") for s in mine]
    single = issubclass(cls, torch.distributed.pipelining.schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, n_microbatches=args.micro_batches, loss_fn=tinygpt.lm_loss)
    timeline = sgp.StageTimeline("cpu")
    for stage in stages:
        stage.timeline = timeline
    params = [p for m in modules.values() for p in m.parameters()]
    intervals, windows = [], []
    for step in range(args.steps):
        ids, targets = tinygpt.batch(data, step, args.micro_batches * args.batch, args.context)
        mark = len(timeline.intervals)
        start = time.perf_counter()
        schedule.step(*((ids,) if 0 in modules else ()), target=targets if num_stages - 1 in modules else None)
        windows.append((start, time.perf_counter()))
        intervals.append([(i.stage, i.kind, i.microbatch, i.start, i.end) for i in timeline.intervals[mark:]])
        for p in params:
            p.grad = None
    return {"intervals": intervals, "windows": windows}


def worker(rank, world, args, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'init')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        tokenizer, data = tinygpt.load_corpus()
        runs = {}
        for name in args.schedules:
            runs[name] = run_schedule(rank, world, name, args, data, tokenizer.vocab_size)
            dist.barrier()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(runs, gathered, dst=0)
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# From the intervals to costs, measured figures and the fitted host costs
# ------------------------------------------------------------------------------------------------


def actions_of(step_intervals):
    """One rank's recorded intervals of one step as simulator actions (stage, kind, mb, start, end):
    a B with a W nested in it is a full backward ("B"), whose W is folded in; a B alone is "I"."""
    bs = [i for i in step_intervals if i[1] == "B"]
    nested = set()
    for w in (i for i in step_intervals if i[1] == "W"):
        for b in bs:
            if b[0] == w[0] and b[2] == w[2] and b[3] <= w[3] and w[4] <= b[4]:
                nested.add((w[0], w[2]))
    out = []
    for stage, kind, mb, start, end in sorted(step_intervals, key=lambda i: i[3]):
        if kind == "W" and (stage, mb) in nested:
            continue
        if kind == "B":
            kind = "B" if (stage, mb) in nested else "I"
        out.append((stage, kind, mb, start, end))
    return out


def stage_costs(runs, num_stages, steps, statistic=statistics.median):
    """F, B (input grad) and W seconds per stage over ``steps`` (their median, or ``statistic``)."""
    samples = {k: {s: [] for s in range(num_stages)} for k in "FBW"}
    for run in runs:
        for step in steps:
            ivs = run["intervals"][step]
            for stage, kind, mb, start, end in ivs:
                if kind == "F":
                    samples["F"][stage].append(end - start)
                elif kind == "W":
                    samples["W"][stage].append(end - start)
                else:  # B: minus its nested W, if any
                    inner = sum(e - s for st, k, m, s, e in ivs
                                if k == "W" and st == stage and m == mb and start <= s and e <= end)
                    samples["B"][stage].append(end - start - inner)
    return {k: [statistic(v[s]) for s in range(num_stages)] for k, v in samples.items()}


def measured(runs, steps):
    times, bubbles = [], []
    for step in steps:
        window = (min(r["windows"][step][0] for r in runs), max(r["windows"][step][1] for r in runs))
        per_rank = [[sgp.Interval(*i) for i in r["intervals"][step]] for r in runs]
        times.append(window[1] - window[0])
        bubbles.append(sgp.bubble_fraction(per_rank, window))
    return statistics.median(times), statistics.median(bubbles)


def host_samples(runs, steps, num_stages, posts=None):
    """Gaps before actions whose input was there (host overhead), the delays from when a remote
    input could move (its producer's end; with ``posts``, torch's receive-post points, also no
    earlier than the receive was posted: gloo's rendezvous) to the waiting consumer's start (p2p),
    and the step time outside the actions."""
    gaps, delays, outside = [], [], []
    for step in steps:
        per_rank = [actions_of(r["intervals"][step]) for r in runs]
        end = {}
        rank_of = {}
        for rank, acts in enumerate(per_rank):
            for stage, kind, mb, s, e in acts:
                rank_of[stage] = rank
                end[(stage, "I" if kind == "B" else kind, mb)] = e
                if kind == "B":
                    end[(stage, "W", mb)] = e
        for rank, acts in enumerate(per_rank):
            for index in range(1, len(acts)):
                stage, kind, mb, start, _ = acts[index]
                prev_end = acts[index - 1][4]
                producer, recv = None, None
                if kind == "F" and stage > 0:
                    producer, recv = (stage - 1, "F", mb), (stage, "F", mb)
                elif kind in ("I", "B") and stage < num_stages - 1:
                    producer, recv = (stage + 1, "I", mb), (stage, "B", mb)
                if producer is not None and rank_of.get(producer[0]) != rank:
                    movable = end[producer]
                    if posts is not None:
                        after = min(posts.get(recv, index - 1), index - 1)
                        movable = max(movable, acts[after][4] if after >= 0 else acts[0][3])
                    if movable >= prev_end:
                        delays.append(start - movable)
                        continue
                gaps.append(start - prev_end)
        first = min(a[3] for acts in per_rank for a in acts)
        last = max(a[4] for acts in per_rank for a in acts)
        window = (min(r["windows"][step][0] for r in runs), max(r["windows"][step][1] for r in runs))
        outside.append((window[1] - window[0]) - (last - first))
    return gaps, delays, outside


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zb1p,zbv,dualpipev")
    parser.add_argument("--steps", type=int, default=8, help="steps per schedule (the first is not measured)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default="out", help="folder for the timeline PNGs")
    parser.add_argument("--save", action="store_true", help="also keep the raw intervals (<out>/*.pt)")
    args = parser.parse_args(argv)
    args.schedules = args.schedules.split(",")
    for name in args.schedules:
        if name not in sim.SCHEDULES:
            parser.error(f"unknown schedule {name!r}; choose from {sorted(sim.SCHEDULES)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not measured)")
    os.makedirs(args.out, exist_ok=True)
    tokens = args.batch * args.context
    print(f"schedule_sim validation, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: "
          f"tinygpt {args.layers} blocks, dim {args.dim}, {args.micro_batches} micro-batches x {args.batch} x "
          f"{args.context} tokens, float32, CPU gloo, {os.cpu_count()} cores, 1 thread per process, "
          f"median over steps 2..{args.steps}")
    worst = {"bubble": 0.0, "step": 0.0}
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, args, tmp), nprocs=world, join=True)
            per_rank = torch.load(os.path.join(tmp, "result.pt"), weights_only=False)
        if args.save:
            torch.save(per_rank, os.path.join(args.out, f"schedule_sim_validation_{world}ranks.pt"))
        steps = range(1, args.steps)
        plans = {name: sim._plan(name, world, args.micro_batches) for name in args.schedules}
        gaps, delays, outside = [], [], []
        for name in args.schedules:
            runs = [r[name] for r in per_rank]
            g, d, o = host_samples(runs, steps, world * sim.SCHEDULES[name][1], plans[name][1])
            gaps += g
            delays += d
            outside += o
        host = {stat.__name__: {"action_overhead": stat(gaps), "latency": stat(delays) if delays else 0.0,
                                "step_overhead": stat(outside)} for stat in (statistics.median, statistics.mean)}
        print(f"\n{world} processes (load average {os.getloadavg()[0]:.1f}): host costs fitted over all schedules "
              f"({len(gaps)} gaps, {len(delays)} waits for a {4 * tokens * args.dim / 1024:.0f} KiB tensor), "
              "median / mean: " + ", ".join(
                  f"{k} {1e3 * host['median'][k]:.2f} / {1e3 * host['mean'][k]:.2f} ms" for k in host["median"]))
        header = (f"{'schedule':>17} | {'F/B/W ms':>14} | {'step ms: meas':>13} | {'costs':>5} | {'+host':>5} | "
                  f"{'mean':>5} | {'err':>6} | {'cores':>5} | {'bubble: meas':>12} | {'costs':>5} | {'+host':>5} | "
                  f"{'mean':>5} | {'err':>5} | {'cores':>5} | order")
        print(header)
        print("-" * len(header))
        drawn = []
        for name in args.schedules:
            runs = [r[name] for r in per_rank]
            num_stages = world * sim.SCHEDULES[name][1]
            step_time, bubble = measured(runs, steps)
            predictions = {}
            cores = os.cpu_count() if world > (os.cpu_count() or world) else None
            variants = [("costs", statistics.median, False, None), ("host", statistics.median, True, None),
                        ("mean", statistics.mean, True, None)]
            if cores:
                variants.append(("cores", statistics.median, True, cores))
            for label, stat, with_host, shared in variants:
                c = stage_costs(runs, num_stages, steps, stat)
                extra = dict(host[stat.__name__], rendezvous=True, cores=shared) if with_host else {}
                predictions[label] = sim.simulate(name, world, args.micro_batches,
                                                  sim.Costs(c["F"], c["B"], c["W"], **extra), tokens)
            best = predictions["mean"]
            same_order = all([a[:3] for a in actions_of(r["intervals"][-1])] == plans[name][0][rank]
                             for rank, r in enumerate(runs))
            step_err = best.step_time / step_time - 1
            bubble_err = 100 * (best.bubble - bubble)
            worst["step"] = max(worst["step"], abs(step_err))
            worst["bubble"] = max(worst["bubble"], abs(bubble_err))
            median_costs = stage_costs(runs, num_stages, steps)
            fbw = "/".join(f"{1e3 * statistics.mean(median_costs[k]):.1f}" for k in "FBW")
            print(f"{best.label:>17} | {fbw:>14} | {1e3 * step_time:>13.0f} | "
                  + " | ".join(f"{1e3 * predictions[k].step_time:>5.0f}" for k in ("costs", "host", "mean"))
                  + f" | {step_err:>+6.1%} | "
                  + (f"{1e3 * predictions['cores'].step_time:>5.0f}" if cores else f"{'-':>5}")
                  + f" | {bubble:>12.1%} | "
                  + " | ".join(f"{100 * predictions[k].bubble:>5.1f}" for k in ("costs", "host", "mean"))
                  + f" | {bubble_err:>+5.1f} | "
                  + (f"{100 * predictions['cores'].bubble:>5.1f}" if cores else f"{'-':>5}")
                  + f" | {'same' if same_order else 'DIFFERENT'}")
            drawn.append(best)
        png = os.path.join(args.out, f"schedule_sim_validation_{world}ranks.png")
        sim.plot_timeline(drawn, png)
        print(f"predicted timelines (with host costs): {png}")
    print("\nF/B/W: the stages' mean of each stage's median. Predictions: 'costs' from the median F/B/W alone; "
          "'+host' adds the median host costs (gloo rendezvous p2p); 'mean' takes the means of both instead; "
          "'cores' is '+host' with the ranks sharing the machine's cores (only where there are more ranks than "
          "cores). err: 'mean' against measured (bubble in points).")
    print(f"largest error ('mean'): step time {worst['step']:.1%}, bubble {worst['bubble']:.1f} points "
          f"(aim: 10%, 3 points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
