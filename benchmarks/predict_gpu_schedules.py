"""Predicts torch's pipeline schedules across GPUs from stage costs measured on one GPU.

Reads ``stage_costs.json`` (benchmarks/measure_stage_costs.py) and feeds each model's measured
per-stage F, B, W times and bytes sent into ``splitgrad.schedule_sim``, which replays the action
lists of torch's own schedule classes, for every schedule, rank count (``--ranks``) and micro-batch
count (``--micro-batches``). A schedule with 2 stages per rank (interleaved 1F1B, ZB-V, DualPipeV)
uses the costs measured for twice as many stages.

The point-to-point model: a tensor between ranks takes ``latency + bytes / bandwidth``, transfers
overlap compute, links do not congest, and stages on one rank (V schedules) pass tensors for free.
The defaults are for H200 SXM GPUs on NVLink 4 through NVSwitch (an HGX board): 18 links of 25 GB/s
per direction, 450 GB/s per direction per GPU at the datasheet's peak, of which a point-to-point
send between two GPUs gets about 80% (``--bandwidth-gbs 360``, what NCCL's all-reduce bus bandwidth
reaches on such boards); ``--latency-us 10`` for a NCCL send/recv pair (kernel launch and the
protocol's handshake for a message of megabytes). Host time between actions is not modelled
(``--action-overhead-us 0``): on a GPU the host queues work ahead of the device; the CPU runs of
BENCHMARKS.md show what it is when it is not hidden.

Memory: each rank's peak along its actions in torch's order, from the measured per-stage sizes
(the schedule_sim rule: F adds the stage's activation, B frees it but keeps the wgrad stash until
W, a full backward frees it), plus each action's measured transient peak while it runs; above the
rank's static memory (parameters and fp32 main_grad, listed beside it; optimizer state not
included). Where the JSON has replays (the actions run for real on the GPU), they are printed next
to this derived figure.

Writes ``<out>/predicted_schedules.md`` (markdown tables), ``<out>/predicted_schedules.json`` and one
timeline PNG per model (``<out>/predicted_<model>_m16.png``: every schedule and rank count at
``--png-micro-batches``).

    python benchmarks/predict_gpu_schedules.py --costs out/stage_costs.json --out out
"""

from __future__ import annotations

import argparse
import json
import os

import splitgrad
from splitgrad import schedule_sim as sim

DEFAULT_SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zb1p,zbv,dualpipev"
_DELTA = {"F": lambda a, s: a, "B": lambda a, s: -a, "I": lambda a, s: s - a, "W": lambda a, s: -s}


def memory_peaks(actions, split) -> list[float] | None:
    """Each rank's peak bytes above its static memory: schedule_sim's memory rule over the rank's
    actions in torch's order, with each action's measured transient while it runs. None where the
    costs have no memory figures (a CPU measurement)."""
    if not split.get("activation_bytes"):
        return None
    act, stash, transient = split["activation_bytes"], split["wgrad_stash_bytes"], split["transient_bytes"]
    peaks = []
    for rank_actions in actions:
        held = peak = 0.0
        for stage, kind, _ in rank_actions:
            peak = max(peak, held + transient[kind][stage])
            held += _DELTA[kind](act[stage], stash[stage])
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def static_per_rank(actions, split) -> list[float]:
    return [sum(split["static_bytes"][s] for s in sorted({a[0] for a in rank_actions})) for rank_actions in actions]


def predict(model: str, entry: dict, name: str, ranks: int, m: int, args) -> dict:
    """One prediction: the simulator's result and memory, or why there is none."""
    label = sim.SCHEDULES[name][2]
    stages = ranks * sim.SCHEDULES[name][1]
    row = {"model": model, "schedule": name, "label": label, "ranks": ranks, "micro_batches": m, "stages": stages}
    split = entry["splits"].get(str(stages))
    if split is None:
        row["skipped"] = f"no costs measured for {stages} stages"
        return row
    if "skipped" in split:
        row["skipped"] = split["skipped"]
        return row
    costs = sim.Costs(split["forward_s"], split["backward_input_s"], split["backward_weight_s"],
                      p2p_bytes=split["p2p_bytes"], latency=args.latency_us * 1e-6,
                      bandwidth=args.bandwidth_gbs * 1e9, action_overhead=args.action_overhead_us * 1e-6)
    try:
        result = sim.simulate(name, ranks, m, costs, entry["tokens_per_microbatch"])
    except splitgrad.ArgumentError as error:  # torch's schedule refuses this micro-batch count
        row["skipped"] = str(error).split(": ", 1)[-1]
        return row
    actions = sim.schedule_actions(name, ranks, m)
    peaks = memory_peaks(actions, split)
    row.update(step_s=result.step_time, tokens_per_s=result.tokens_per_s, bubble=result.bubble,
               peak_bytes=peaks, static_bytes=static_per_rank(actions, split), result=result)
    return row


def size(n, unit: str) -> str:
    return "–" if n is None else f"{n / {'GiB': 2**30, 'MiB': 2**20}[unit]:.2f}"


def markdown(rows, payload, args) -> str:
    lines = [f"Predicted from stage costs measured {payload['date']} on {payload['device']} (torch "
             f"{payload['torch']}, {payload['timing']} over {payload['repeats']} repeats); p2p: "
             f"{args.latency_us:g} µs + bytes / {args.bandwidth_gbs:g} GB/s; host time between actions "
             f"{args.action_overhead_us:g} µs. Peak: activation memory of the fullest rank above its "
             "static memory (parameters + fp32 main_grad, the static column: the same rank), derived "
             "from the measured per-stage sizes and transients. vs 1F1B: 1F1B's step time over this "
             "schedule's (same ranks and micro-batches).", ""]
    for model, entry in payload["models"].items():
        cfg = entry["config"]
        mine = [r for r in rows if r["model"] == model]
        largest = max([p for r in mine for p in (r.get("peak_bytes") or []) + r.get("static_bytes", [])], default=0)
        unit = "GiB" if largest >= 2**30 else "MiB"
        lines += [f"### {model}: dim {cfg['dim']}, {cfg['layers']} blocks, context {cfg['context']}, "
                  f"{entry['tokens_per_microbatch']} tokens per micro-batch, {entry['parameters'] / 1e6:.0f}M "
                  f"parameters, {cfg['dtype']}", "",
                  "| schedule | ranks | micro-batches | step ms | tokens/s | bubble | vs 1F1B | "
                  f"peak {unit} | static {unit} |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base = {(r["ranks"], r["micro_batches"]): r["step_s"] for r in mine
                if r["schedule"] == "1f1b" and "step_s" in r}
        for r in mine:
            if "skipped" in r:
                lines.append(f"| {r['label']} | {r['ranks']} | {r['micro_batches']} |" + " – |" * 6)
                continue
            fullest = max(range(r["ranks"]), key=lambda k: (r["peak_bytes"] or r["static_bytes"])[k])
            speed = base.get((r["ranks"], r["micro_batches"]))
            versus = f"{speed / r['step_s']:.3f}×" if speed else "–"
            lines.append(f"| {r['label']} | {r['ranks']} | {r['micro_batches']} | {1e3 * r['step_s']:.2f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['bubble']:.1%} | "
                         f"{versus} | "
                         f"{size(r['peak_bytes'][fullest] if r['peak_bytes'] else None, unit)} | "
                         f"{size(r['static_bytes'][fullest], unit)} |")
        skipped = sorted({f"{r['label']} on {r['ranks']} ranks with {r['micro_batches']} micro-batches: {r['skipped']}"
                          for r in mine if "skipped" in r})
        if skipped:
            lines += ["", "–: " + "; ".join(skipped)]
        replays = [rp for rp in entry.get("replays", []) if "peak_bytes" in rp]
        if replays:
            lines += ["", f"Peak memory per rank, {unit} above static: replayed on the device (the rank's actions "
                          "run for real, in one process) against derived (the table's method)", "",
                      "| schedule | ranks | micro-batches | replayed | derived |", "|---|---:|---:|---|---|"]
            for rp in replays:
                split = entry["splits"].get(str(rp["ranks"] * sim.SCHEDULES[rp["schedule"]][1]), {})
                derived = memory_peaks(sim.schedule_actions(rp["schedule"], rp["ranks"], rp["micro_batches"]), split) \
                    if "forward_s" in split else None
                lines.append(f"| {sim.SCHEDULES[rp['schedule']][2]} | {rp['ranks']} | {rp['micro_batches']} | "
                             + " / ".join(size(p, unit) for p in rp["peak_bytes"]) + " | "
                             + (" / ".join(size(p, unit) for p in derived) if derived else "–") + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", default="out/stage_costs.json", help="measure_stage_costs.py's JSON")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES)
    parser.add_argument("--bandwidth-gbs", type=float, default=360.0, help="GB/s per direction between two GPUs")
    parser.add_argument("--latency-us", type=float, default=10.0, help="µs per point-to-point transfer")
    parser.add_argument("--action-overhead-us", type=float, default=0.0, help="idle host µs before each action")
    parser.add_argument("--png-micro-batches", type=int, default=None,
                        help="the micro-batch count drawn (default 16, or the first of --micro-batches without it)")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    try:
        with open(args.costs) as f:
            payload = json.load(f)
    except (OSError, ValueError) as error:
        parser.error(f"--costs {args.costs!r}: cannot read it ({error}); run benchmarks/measure_stage_costs.py first")
    schedules = args.schedules.split(",")
    for name in schedules:
        if name not in sim.SCHEDULES:
            parser.error(f"--schedules: unknown schedule {name!r} (choose from {sorted(sim.SCHEDULES)})")
    if not (args.bandwidth_gbs > 0 and args.latency_us >= 0 and args.action_overhead_us >= 0):
        parser.error("--bandwidth-gbs must be > 0, --latency-us and --action-overhead-us >= 0")
    if args.png_micro_batches is None:
        args.png_micro_batches = 16 if 16 in args.micro_batches else args.micro_batches[0]
    if any(r < 2 for r in args.ranks) or any(m < 1 for m in args.micro_batches):
        parser.error("--ranks must be >= 2 and --micro-batches >= 1")
    os.makedirs(args.out, exist_ok=True)
    try:
        import matplotlib  # noqa: F401  (schedule_sim.plot_timeline draws with it)
        plots = True
    except ImportError:
        plots = False
        print("matplotlib is not installed: no timeline PNGs")
    rows, pngs = [], []
    for model, entry in payload["models"].items():
        drawn = []
        for ranks in args.ranks:
            for m in args.micro_batches:
                for name in schedules:
                    row = predict(model, entry, name, ranks, m, args)
                    rows.append(row)
                    if m == args.png_micro_batches and "result" in row:
                        drawn.append(row["result"])
        if drawn and plots:  # one PNG per model: few files come back from a device machine
            path = os.path.join(args.out, f"predicted_{model}_m{args.png_micro_batches}.png")
            sim.plot_timeline(drawn, path)
            pngs.append(path)
    text = markdown(rows, payload, args)
    print(text)
    md = os.path.join(args.out, "predicted_schedules.md")
    with open(md, "w") as f:
        f.write(text + "\n")
    out_json = os.path.join(args.out, "predicted_schedules.json")
    with open(out_json, "w") as f:
        json.dump({"costs": args.costs, "bandwidth_gbs": args.bandwidth_gbs, "latency_us": args.latency_us,
                   "action_overhead_us": args.action_overhead_us,
                   "rows": [{k: v for k, v in r.items() if k != "result"} for r in rows]}, f, indent=1)
    print(f"{md}\n{out_json}\n" + "\n".join(pngs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
