"""Measures, on one GPU (or the CPU at a tiny size), what splitgrad.schedule_sim needs to predict the
main job's pipeline schedules across GPUs: per stage, the F, B (input gradients) and W (deferred
weight gradients) time of one micro-batch, the bytes the stage sends per micro-batch, and its
memory; and each rank's peak memory under each schedule, replayed.

Every stage runs in this one process on one device. The model is examples/demo.py's (``--model``:
the same pieces, delayed ``splitgrad.Linear`` projections, bf16 with fused fp32 ``main_grad`` on
CUDA), cut into S stages as the main job cuts it (``tinygpt.stage_pieces``), for every S the
predictions need (each rank count times 1 and 2 stages per rank). A stage gets random inputs of the
shape it receives (token ids on the first; an activation that requires grad on the others, as a
received one does); the last stage's F includes the loss.

- **Time** (``--repeats`` after ``--warmup``, the median): F, B, W of one micro-batch in turn, with
  CUDA events at the boundaries, so each is the device time of the action as eager PyTorch issues
  it (a GPU waiting for the host's launches counts: it would wait in the pipeline too). On the CPU,
  ``time.perf_counter``.
- **Bytes sent** per micro-batch: the size of the stage's output (its gradient comes back, the same
  size); the last stage sends nothing forward.
- **Memory per action** (CUDA only): ``torch.cuda.memory_allocated`` before and after each of F, B,
  W of one micro-batch, and ``max_memory_allocated`` during it: the activation a micro-batch holds
  from its F to its B (``activation_bytes``), what its B leaves held until its W (the deferred
  wgrad's stash, ``wgrad_stash_bytes``), and each action's transient peak above its starting level.
  ``static_bytes``: the stage's parameters and fp32 ``main_grad`` (optimizer state not included).
- **Peak memory per schedule, replayed** (CUDA only): for ``--replay-ranks`` ranks and
  ``--replay-micro-batches``, each rank's compute actions in torch's own order
  (``schedule_sim.schedule_actions``) run for real in this process (F keeps its input and output,
  B runs the backward with a random output gradient and drops them, W runs the stage's deferred
  wgrad), and ``max_memory_allocated`` above the rank's static memory is its peak. The zero-bubble
  schedules hold W's stash from B to W: this measures what that costs.

Writes ``<out>/stage_costs.json`` (read by benchmarks/predict_gpu_schedules.py) and prints a table.

    bash scripts/gpu_run.sh python benchmarks/measure_stage_costs.py --out out       # the GPU sizes
    python benchmarks/measure_stage_costs.py --device cpu --model tiny --ranks 2      # a tiny CPU check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from tqdm import tqdm

import splitgrad
from splitgrad import schedule_sim as sim

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import demo  # noqa: E402  (examples/demo.py: the main job's model sizes and mixed precision)
import tinygpt  # noqa: E402

DEFAULT_SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zb1p,zbv,dualpipev"


class Clock:
    """CUDA events on a GPU, perf_counter on the CPU: ``mark()`` then ``elapsed(a, b)`` in seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, a, b) -> float:
        if not self.cuda:
            return b - a
        return a.elapsed_time(b) / 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Stage:
    """One stage's module and how to feed it: F, B (input gradients) and W of one micro-batch."""

    def __init__(self, module, index: int, num_stages: int, cfg, device, dtype) -> None:
        self.module, self.index, self.num_stages = module, index, num_stages
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.layers = [m for m in module.modules() if isinstance(m, splitgrad.Linear) and m.delay_wgrad_compute]
        self.queue: list[int] = []  # micro-batches whose B ran and whose W has not, oldest first

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    def make_input(self):
        b, t = self.cfg.batch, self.cfg.context
        if self.first:
            return torch.randint(0, self.cfg.vocab, (b, t), device=self.device)
        return torch.randn(b, t, self.cfg.dim, device=self.device, dtype=self.dtype, requires_grad=True)

    def forward(self, x):
        """The stage's output (its loss on the last stage), kept with its input for B."""
        out = self.module(x)
        if self.last:
            targets = torch.randint(0, self.cfg.vocab, (self.cfg.batch, self.cfg.context), device=self.device)
            out = tinygpt.lm_loss(out, targets)
        return out

    def output_gradient(self, out):
        return None if self.last else torch.randn_like(out)

    def backward_input(self, mb: int, out, grad) -> None:
        torch.autograd.backward(out, grad)
        self.queue.append(mb)

    def backward_weight(self, mb: int) -> None:
        """Runs micro-batch ``mb``'s deferred wgrad: each layer's oldest pending pass, which is
        ``mb``'s as long as the stage's W steps come in the order of its B steps."""
        if not self.queue or self.queue[0] != mb:
            raise RuntimeError(f"stage {self.index}: W of micro-batch {mb} while the oldest B without its W "
                               f"is {self.queue[:1]} (this replay needs W in the order of B)")
        self.queue.pop(0)
        for layer in reversed(self.layers):
            layer.backward_dw()

    def static_bytes(self) -> int:
        total = 0
        for p in self.module.parameters():
            total += p.numel() * p.element_size()
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                total += main_grad.numel() * main_grad.element_size()
        return total


def build_model(name: str, device: torch.device, dtype_name: str | None):
    """examples/demo.py's model ``name`` on ``device``: its pieces (fp32 main_grads attached below
    float32) and its resolved shape."""
    cfg = SimpleNamespace(model=name, device=device.type, dtype=dtype_name,
                          **{k: None for k in demo.SHAPE_OPTIONS})
    tokenizer, _ = tinygpt.load_corpus()
    cfg.vocab = demo.resolve_model(cfg, tokenizer.vocab_size)
    dtype = getattr(torch, cfg.dtype)
    pieces = tinygpt.build_pieces(demo.fused_linear_factory(device, dtype), vocab=cfg.vocab, dim=cfg.dim,
                                  heads=cfg.heads, layers=cfg.layers, context=cfg.context, seed=0, device=device,
                                  dtype=dtype)
    splitgrad.name_layers(torch.nn.Sequential(*pieces))
    if dtype != torch.float32:
        demo.attach_main_grads(pieces)
    return pieces, cfg, dtype


def stages_for(pieces, num_stages, cfg, device, dtype) -> list[Stage]:
    return [Stage(tinygpt.stage_module(pieces, s, num_stages), s, num_stages, cfg, device, dtype)
            for s in range(num_stages)]


def measure_split(stages: list[Stage], clock: Clock, args, progress) -> dict:
    """F / B / W seconds (median), bytes sent and memory per action of every stage."""
    cuda = clock.cuda
    result = {k: [] for k in ("forward_s", "backward_input_s", "backward_weight_s", "p2p_bytes")}
    memory = {k: [] for k in ("activation_bytes", "wgrad_stash_bytes", "static_bytes")}
    transient = {k: [] for k in "FIWB"}
    for stage in stages:
        samples = {"F": [], "I": [], "W": []}
        for rep in range(args.warmup + args.repeats + (1 if cuda else 0)):
            x = stage.make_input()
            clock.sync()
            measuring_memory = cuda and rep == args.warmup + args.repeats  # one extra, untimed pass
            if measuring_memory:
                level, peaks = [], []
                torch.cuda.reset_peak_memory_stats()
                level.append(torch.cuda.memory_allocated())
            t0 = clock.mark()
            out = stage.forward(x)
            t1 = clock.mark()
            if measuring_memory:
                level.append(torch.cuda.memory_allocated())
                peaks.append(torch.cuda.max_memory_allocated())
            grad = stage.output_gradient(out)
            if rep == 0:
                result["p2p_bytes"].append(0 if stage.last else out.numel() * out.element_size())
            if measuring_memory:
                torch.cuda.reset_peak_memory_stats()
            t2 = clock.mark()
            stage.backward_input(rep, out, grad)
            del out, grad, x  # B done: the stage drops its input, output and the gradients it sent
            t3 = clock.mark()
            if measuring_memory:
                level.append(torch.cuda.memory_allocated())
                peaks.append(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            t4 = clock.mark()
            stage.backward_weight(rep)
            t5 = clock.mark()
            clock.sync()
            if measuring_memory:
                level.append(torch.cuda.memory_allocated())
                peaks.append(torch.cuda.max_memory_allocated())
                start, after_f, after_i, after_w = level
                activation = after_f - start
                stash = after_i - start
                t_f = peaks[0] - start
                t_i = peaks[1] - after_f  # the received gradient is part of B's transient
                t_w = peaks[2] - after_i
                memory["activation_bytes"].append(activation)
                memory["wgrad_stash_bytes"].append(stash)
                transient["F"].append(t_f)
                transient["I"].append(t_i)
                transient["W"].append(t_w)
                transient["B"].append(max(t_i, stash - activation + t_w))  # a full backward: B, then W at once
            elif rep >= args.warmup:
                samples["F"].append(clock.elapsed(t0, t1))
                samples["I"].append(clock.elapsed(t2, t3))
                samples["W"].append(clock.elapsed(t4, t5))
        if splitgrad.pending_wgrads():
            raise RuntimeError(f"stage {stage.index}: deferred work left after measuring: "
                               f"{splitgrad.layers_with_pending_wgrads()}")
        result["forward_s"].append(statistics.median(samples["F"]))
        result["backward_input_s"].append(statistics.median(samples["I"]))
        result["backward_weight_s"].append(statistics.median(samples["W"]))
        memory["static_bytes"].append(stage.static_bytes())
        progress.update(1)
    result["pieces"] = [[int(k) for k in stage.module._modules] for stage in stages]
    if cuda:
        result.update(memory)
        result["transient_bytes"] = transient
    else:
        result.update({k: None for k in memory}, transient_bytes=None)
        result["static_bytes"] = memory["static_bytes"]
    return result


def replay(stages: list[Stage], name: str, ranks: int, micro_batches: int) -> list[int]:
    """Each rank's actions of schedule ``name`` in torch's order, run for real; the peak bytes
    allocated above the level the rank started from, per rank."""
    plan = sim.schedule_actions(name, ranks, micro_batches)
    peaks = []
    for actions in plan:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        held: dict[tuple[int, int], tuple] = {}
        for s, kind, mb in actions:
            stage = stages[s]
            if kind == "F":
                x = stage.make_input()
                held[(s, mb)] = (x, stage.forward(x))
                del x
                continue
            if kind in ("I", "B"):
                x, out = held.pop((s, mb))
                grad = stage.output_gradient(out)
                stage.backward_input(mb, out, grad)
                del x, out, grad
            if kind in ("W", "B"):
                stage.backward_weight(mb)
        torch.cuda.synchronize()
        if held or splitgrad.pending_wgrads():
            raise RuntimeError(f"replay of {name}: left over {sorted(held)}, {splitgrad.pending_wgrads()} pending")
        peaks.append(torch.cuda.max_memory_allocated() - base)
    return peaks


def needed_splits(ranks: list[int], schedules: list[str]) -> list[int]:
    return sorted({r * sim.SCHEDULES[name][1] for r in ranks for name in schedules})


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_model(name: str, entry: dict) -> None:
    cfg = entry["config"]
    print(f"\n{name}: dim {cfg['dim']}, {cfg['heads']} heads, {cfg['layers']} blocks, context {cfg['context']}, "
          f"{cfg['batch']} sequences x {cfg['context']} = {entry['tokens_per_microbatch']} tokens per micro-batch, "
          f"vocab {cfg['vocab']}, {entry['parameters'] / 1e6:.0f}M parameters, {cfg['dtype']}")
    header = (f"{'stages':>6} | {'stage':>5} | {'blocks':>6} | {'F ms':>7} | {'B ms':>7} | {'W ms':>7} | "
              f"{'F:B:W':>14} | {'sends MiB':>9} | {'act GiB':>7} | {'stash GiB':>9} | {'static GiB':>10}")
    print(header)
    print("-" * len(header))
    for count, split in entry["splits"].items():
        if "skipped" in split:
            print(f"{count:>6} | {split['skipped']}")
            continue
        for s in range(int(count)):
            f, b, w = (split[k][s] for k in ("forward_s", "backward_input_s", "backward_weight_s"))
            blocks = sum(1 for p in split["pieces"][s] if 0 < p <= cfg["layers"])
            act = split["activation_bytes"][s] if split["activation_bytes"] else None
            stash = split["wgrad_stash_bytes"][s] if split["wgrad_stash_bytes"] else None
            print(f"{count:>6} | {s:>5} | {blocks:>6} | {1e3 * f:>7.3f} | {1e3 * b:>7.3f} | {1e3 * w:>7.3f} | "
                  f"{f'1:{b / f:.2f}:{w / f:.2f}':>14} | {split['p2p_bytes'][s] / 2**20:>9.1f} | {gib(act):>7} | "
                  f"{gib(stash):>9} | {gib(split['static_bytes'][s]):>10}")
    if entry["replays"]:
        print(f"peak memory replayed (GiB above the rank's parameters and main_grads; per rank), "
              f"{entry['replays'][0]['micro_batches']} micro-batches:")
        for r in entry["replays"]:
            label = sim.SCHEDULES[r["schedule"]][2]
            peaks = " / ".join(gib(p) for p in r["peak_bytes"]) if "peak_bytes" in r else f"not run: {r['error']}"
            print(f"  {label:>17}, {r['ranks']} ranks: {peaks}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=None, choices=list(demo.MODELS),
                        help="model sizes (default: small gpt2-medium 1b on CUDA, tiny on the CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: the model's (bfloat16 for the GPU sizes, float32 for tiny)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8],
                        help="the rank counts to predict: stage counts measured are these x 1 and x 2")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--replay-ranks", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--replay-micro-batches", type=int, default=8)
    parser.add_argument("--out", default="out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (use --device cpu --model tiny for a CPU check)")
    models = args.model or (["tiny"] if args.device == "cpu" else ["small", "gpt2-medium", "1b"])
    schedules = args.schedules.split(",")
    for name in schedules:
        if name not in sim.SCHEDULES:
            parser.error(f"--schedules: unknown schedule {name!r} (choose from {sorted(sim.SCHEDULES)})")
    if args.warmup < 0 or args.repeats < 1 or args.replay_micro_batches < 1 or any(r < 2 for r in args.ranks):
        parser.error("--warmup must be >= 0, --repeats and --replay-micro-batches >= 1, --ranks >= 2")
    if any(r < 2 for r in args.replay_ranks):
        parser.error("--replay-ranks must be >= 2")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    splits = needed_splits(args.ranks, schedules)
    replay_cases = [(n, r) for r in args.replay_ranks for n in schedules] if device.type == "cuda" else []
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    payload = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "device": (torch.cuda.get_device_name(0) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None,
        "torch": torch.__version__, "warmup": args.warmup, "repeats": args.repeats,
        "timing": "CUDA events, median" if device.type == "cuda" else "perf_counter, median",
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
        "models": {},
    }
    total = 0
    for name in models:
        layers = demo.MODELS[name]["layers"]
        total += sum(s for s in splits if s <= layers)
    progress = tqdm(total=total + len(models) * len(replay_cases), unit="stage", disable=args.quiet,
                    desc="measuring", mininterval=0.5)
    for name in models:
        pieces, cfg, dtype = build_model(name, device, args.dtype)
        entry = {"config": {k: getattr(cfg, k) for k in ("dim", "heads", "layers", "context", "batch", "vocab",
                                                           "dtype")},
                 "tokens_per_microbatch": cfg.batch * cfg.context,
                 "parameters": sum(p.numel() for p in {id(p): p for m in pieces for p in m.parameters()}.values()),
                 "splits": {}, "replays": []}
        for count in splits:
            progress.set_description(f"{name}: {count} stages")
            if count > cfg.layers:
                entry["splits"][str(count)] = {"skipped": f"{count} stages need at least {count} blocks, "
                                                          f"{name} has {cfg.layers}"}
                continue
            entry["splits"][str(count)] = measure_split(stages_for(pieces, count, cfg, device, dtype),
                                                        Clock(device), args, progress)
        for schedule, ranks in replay_cases:
            progress.set_description(f"{name}: replay {schedule}, {ranks} ranks")
            count = ranks * sim.SCHEDULES[schedule][1]
            if count <= cfg.layers:
                stages = stages_for(pieces, count, cfg, device, dtype)
                try:
                    peaks = replay(stages, schedule, ranks, args.replay_micro_batches)
                except splitgrad.ArgumentError as error:  # a micro-batch count torch's schedule refuses
                    peaks = str(error)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    peaks = "out of memory"
                if isinstance(peaks, list):
                    entry["replays"].append({"schedule": schedule, "ranks": ranks,
                                             "micro_batches": args.replay_micro_batches, "peak_bytes": peaks})
                else:
                    entry["replays"].append({"schedule": schedule, "ranks": ranks,
                                             "micro_batches": args.replay_micro_batches, "error": peaks})
            progress.update(1)
        payload["models"][name] = entry
        del pieces
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    payload["seconds"] = round(time.time() - started, 1)
    path = os.path.join(args.out, "stage_costs.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"stage costs, {payload['date']}, {payload['device']}, torch {payload['torch']}: {payload['timing']} "
          f"over {args.repeats} repeats after {args.warmup} warm-up; B = input gradients, W = deferred weight "
          "gradients; act: held from F to B, stash: held from B to W; static: parameters + fp32 main_grad")
    for name, entry in payload["models"].items():
        print_model(name, entry)
    print(f"\n{path} ({payload['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
