"""Measures, on one GPU (or the CPU at a tiny size), what splitgrad.schedule_sim needs to predict the
main job's pipeline schedules across GPUs: per stage, the F, B (input gradients) and W (deferred
weight gradients) time of one micro-batch, the bytes the stage sends per micro-batch, and its
memory; and each rank's peak memory under each schedule, replayed.

Every stage runs in this one process on one device. The model is examples/demo.py's (``--model``:
the same pieces: delayed ``splitgrad.LayerNormLinear`` / ``Linear`` / ``LayerNormMLP`` modules, bf16
with fused fp32 ``main_grad`` on CUDA), cut into S stages as the main job cuts it
(``tinygpt.stage_pieces``), for every S the predictions need (each rank count times 1 and 2 stages
per rank). A stage gets random inputs of the shape it receives (token ids on the first; an
activation that requires grad on the others, as a received one does); the last stage's F includes
the loss.

- **Time** (``--repeats`` after ``--warmup``, the median): F, B, W of one micro-batch in turn, with
  CUDA events at the boundaries, so each is the device time of the action as eager PyTorch issues
  it (a GPU waiting for the host's launches counts: it would wait in the pipeline too). On the CPU,
  ``time.perf_counter``.
- **Bytes sent** per micro-batch: the size of the stage's output (its gradient comes back, the same
  size); the last stage sends nothing forward.
- **Memory per action**: ``torch.cuda.memory_allocated`` before and after each of F, B, W of one
  micro-batch, and ``max_memory_allocated`` during it (on the CPU, which keeps no such counters, the
  bytes of the tensors the operators create, counted by a dispatch mode: ``CpuMemory``): the
  activation a micro-batch holds
  from its F to its B (``activation_bytes``), what its B leaves held until its W (the deferred
  wgrad's stash, ``wgrad_stash_bytes``), and each action's transient peak above its starting level.
  ``static_bytes``: the stage's parameters and fp32 ``main_grad`` (optimizer state not included).
- **Peak memory per schedule, replayed**: for ``--replay-ranks`` ranks and
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
import traceback
from types import SimpleNamespace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
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
        self.device = device
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
    """One pipeline stage to measure: its module, and how to make the input it receives.

    ``make_input()`` returns one micro-batch's input (what the stage receives: token ids on the
    first stage, an activation with ``requires_grad=True`` on the others); on the last stage
    ``loss_fn(output)`` turns the output into the loss, inside F. W runs the module's delayed
    splitgrad layers' deferred wgrad. Any model cut into stage modules can be measured this way.
    """

    def __init__(self, module, index: int, num_stages: int, make_input, loss_fn=None) -> None:
        self.module, self.index, self.num_stages = module, index, num_stages
        self.make_input, self.loss_fn = make_input, loss_fn
        self.layers = [m for m in module.modules()
                       if isinstance(m, demo.SPLITGRAD_MODULES) and m.delay_wgrad_compute]
        self.queue: list[int] = []  # micro-batches whose B ran and whose W has not, oldest first

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x):
        """The stage's output (its loss on the last stage), kept with its input for B."""
        out = self.module(x)
        return self.loss_fn(out) if self.last and self.loss_fn is not None else out

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
    pieces = tinygpt.build_pieces(demo.delayed_layers(device, dtype), vocab=cfg.vocab, dim=cfg.dim,
                                  heads=cfg.heads, layers=cfg.layers, context=cfg.context, seed=0, device=device,
                                  dtype=dtype)
    splitgrad.name_layers(torch.nn.Sequential(*pieces))
    if dtype != torch.float32:
        demo.attach_main_grads(pieces)
    return pieces, cfg, dtype


def stages_for(pieces, num_stages, cfg, device, dtype) -> list[Stage]:
    """The main job's model cut into ``num_stages`` stages as the demo cuts it, with random inputs
    of the shapes they receive."""
    b, t = cfg.batch, cfg.context

    def ids():
        return torch.randint(0, cfg.vocab, (b, t), device=device)

    def activation():
        return torch.randn(b, t, cfg.dim, device=device, dtype=dtype, requires_grad=True)

    def loss(logits):
        return tinygpt.lm_loss(logits, ids())

    return [Stage(tinygpt.stage_module(pieces, s, num_stages), s, num_stages, ids if s == 0 else activation, loss)
            for s in range(num_stages)]


class CudaMemory:
    """Bytes allocated, from the CUDA caching allocator's counters."""

    def __enter__(self):
        torch.cuda.synchronize()
        return self

    def __exit__(self, *exc):
        return False

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()


class CpuMemory(TorchDispatchMode):
    """The CPU has no allocator statistics: this counts the bytes of the storages of tensors that
    operators create while it is active (alive until their storage is freed) and their peak after
    each operator; buffers a kernel frees before it returns are missed. Enough to check the
    measurement on the CPU; on a GPU, CudaMemory counts."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.top = 0

    def track(self, tensors) -> None:
        """Counts tensors made elsewhere too (gradients a backward may replace): their bytes drop
        out when they are freed."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.live and storage.nbytes():
                    self.live[ref.cdata] = (ref, storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        self.top = max(self.top, self.allocated())
        return out

    def allocated(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())

    def peak(self) -> int:
        return max(self.top, self.allocated())

    def reset_peak(self) -> None:
        self.top = self.allocated()


def memory_meter(device: torch.device, stages: list[Stage]):
    """The device's meter; on the CPU it also counts the stages' gradients, which a backward may
    replace by new tensors rather than add to in place."""
    if device.type == "cuda":
        return CudaMemory()
    meter = CpuMemory()
    for stage in stages:
        meter.track(t for p in stage.module.parameters() for t in (p.grad, getattr(p, "main_grad", None)))
    return meter


def measure_split(stages: list[Stage], device, warmup: int = 3, repeats: int = 20, progress=None) -> dict:
    """F / B / W seconds (median over ``repeats`` after ``warmup``), bytes sent and memory per
    action of every stage (run one after the other on ``device``), and the parameter bytes."""
    device = torch.device(device)
    clock = Clock(device)
    result = {k: [] for k in ("forward_s", "backward_input_s", "backward_weight_s", "p2p_bytes", "activation_bytes",
                              "wgrad_stash_bytes", "static_bytes")}
    result["transient_bytes"] = {k: [] for k in "FIWB"}
    for stage in stages:
        samples = {"F": [], "I": [], "W": []}
        for rep in range(warmup + repeats):
            x = stage.make_input()
            clock.sync()
            t0 = clock.mark()
            out = stage.forward(x)
            t1 = clock.mark()
            grad = stage.output_gradient(out)
            if rep == 0:
                result["p2p_bytes"].append(0 if stage.last else out.numel() * out.element_size())
            t2 = clock.mark()
            stage.backward_input(rep, out, grad)
            t3 = clock.mark()
            del out, grad, x
            t4 = clock.mark()
            stage.backward_weight(rep)
            t5 = clock.mark()
            clock.sync()
            if rep >= warmup:
                samples["F"].append(clock.elapsed(t0, t1))
                samples["I"].append(clock.elapsed(t2, t3))
                samples["W"].append(clock.elapsed(t4, t5))
        for key, kind in (("forward_s", "F"), ("backward_input_s", "I"), ("backward_weight_s", "W")):
            result[key].append(statistics.median(samples[kind]))
        memory = measure_memory(stage, memory_meter(device, [stage]))
        for key in ("activation_bytes", "wgrad_stash_bytes"):
            result[key].append(memory[key])
        for kind in "FIWB":
            result["transient_bytes"][kind].append(memory[kind])
        result["static_bytes"].append(stage.static_bytes())
        if splitgrad.pending_wgrads():
            raise RuntimeError(f"stage {stage.index}: deferred work left after measuring: "
                               f"{splitgrad.layers_with_pending_wgrads()}")
        if progress is not None:
            progress.update(1)
    return result


def measure_memory(stage: Stage, meter) -> dict:
    """One micro-batch's F, B, W with the meter: what F leaves held until B (the received input,
    the output and autograd's saved tensors), what B leaves held until W (the deferred wgrad's
    stash), and each action's transient peak above the level it starts from (B's includes the
    received output gradient)."""
    with meter:
        meter.reset_peak()
        start = meter.allocated()
        x = stage.make_input()
        out = stage.forward(x)
        after_f, peak_f = meter.allocated(), meter.peak()
        meter.reset_peak()
        grad = stage.output_gradient(out)
        stage.backward_input(-1, out, grad)
        del out, grad, x  # B done: the stage drops its input, output and the gradient it received
        after_i, peak_i = meter.allocated(), meter.peak()
        meter.reset_peak()
        stage.backward_weight(-1)
        peak_w = meter.peak()
    activation, stash = after_f - start, after_i - start
    t_i, t_w = peak_i - after_f, peak_w - after_i
    return {"activation_bytes": activation, "wgrad_stash_bytes": stash, "F": peak_f - start, "I": t_i, "W": t_w,
            "B": max(t_i, stash - activation + t_w)}  # a full backward: B, then its W at once


def replay(stages: list[Stage], name: str, ranks: int, micro_batches: int, meter=None) -> list[int]:
    """Each rank's actions of schedule ``name`` in torch's order, run for real; the peak bytes
    allocated above the level the rank started from, per rank. ``stages``: all ``ranks`` x the
    schedule's stages per rank, on one device."""
    if meter is None:
        meter = memory_meter(next(stages[0].module.parameters()).device, stages)
    plan = sim.schedule_actions(name, ranks, micro_batches)
    peaks = []
    for actions in plan:
        with meter:
            meter.reset_peak()
            base = meter.allocated()
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
            peak = meter.peak() - base
        if held or splitgrad.pending_wgrads():
            raise RuntimeError(f"replay of {name}: left over {sorted(held)}, {splitgrad.pending_wgrads()} pending")
        peaks.append(peak)
    return peaks


def measure_model(name: str, args, device, splits: list[int], replay_cases, progress) -> dict:
    """One model size: its stage costs for every split and its schedule replays."""
    pieces, cfg, dtype = build_model(name, device, args.dtype)
    entry = {"config": {k: getattr(cfg, k) for k in ("dim", "heads", "layers", "context", "batch", "vocab",
                                                       "dtype")},
             "tokens_per_microbatch": cfg.batch * cfg.context,
             # the model's, tied (static_bytes counts the output layer's copy of the embedding too)
             "parameters": sum(p.numel() for m in pieces for p in m.parameters()) - pieces[-1].out.weight.numel(),
             "splits": {}, "replays": []}
    for count in splits:
        progress.set_description(f"{name}: {count} stages")
        if count > cfg.layers:
            entry["splits"][str(count)] = {"skipped": f"{count} stages need at least {count} blocks, "
                                                      f"{name} has {cfg.layers}"}
            continue
        split = measure_split(stages_for(pieces, count, cfg, device, dtype), device, args.warmup, args.repeats,
                              progress)
        split["pieces"] = [tinygpt.stage_pieces(len(pieces), s, count) for s in range(count)]
        entry["splits"][str(count)] = split
    for schedule, ranks in replay_cases:
        progress.set_description(f"{name}: replay {schedule}, {ranks} ranks")
        count = ranks * sim.SCHEDULES[schedule][1]
        if count <= cfg.layers:
            stages = stages_for(pieces, count, cfg, device, dtype)
            try:
                peaks = replay(stages, schedule, ranks, args.replay_micro_batches, memory_meter(device, stages))
            except splitgrad.ArgumentError as error:  # a micro-batch count torch's schedule refuses
                peaks = str(error)
            except torch.cuda.OutOfMemoryError:
                peaks = "out of memory"
                splitgrad.backward_dw_all()  # the stashes of the B steps that ran: drop them
                torch.cuda.empty_cache()
            if isinstance(peaks, list):
                entry["replays"].append({"schedule": schedule, "ranks": ranks,
                                         "micro_batches": args.replay_micro_batches, "peak_bytes": peaks})
            else:
                entry["replays"].append({"schedule": schedule, "ranks": ranks,
                                         "micro_batches": args.replay_micro_batches, "error": peaks})
        progress.update(1)
    return entry


def needed_splits(ranks: list[int], schedules: list[str]) -> list[int]:
    return sorted({r * sim.SCHEDULES[name][1] for r in ranks for name in schedules})


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def print_model(name: str, entry: dict) -> None:
    cfg = entry["config"]
    print(f"\n{name}: dim {cfg['dim']}, {cfg['heads']} heads, {cfg['layers']} blocks, context {cfg['context']}, "
          f"{cfg['batch']} sequences x {cfg['context']} = {entry['tokens_per_microbatch']} tokens per micro-batch, "
          f"vocab {cfg['vocab']}, {entry['parameters'] / 1e6:.0f}M parameters, {cfg['dtype']}")
    header = (f"{'stages':>6} | {'stage':>5} | {'blocks':>6} | {'F ms':>7} | {'B ms':>7} | {'W ms':>7} | "
              f"{'F:B:W':>14} | {'sends MiB':>9} | {'act MiB':>8} | {'stash MiB':>9} | {'static MiB':>10}")
    print(header)
    print("-" * len(header))
    for count, split in entry["splits"].items():
        if "skipped" in split:
            print(f"{count:>6} | {split['skipped']}")
            continue
        for s in range(int(count)):
            f, b, w = (split[k][s] for k in ("forward_s", "backward_input_s", "backward_weight_s"))
            blocks = sum(1 for p in split["pieces"][s] if 0 < p <= cfg["layers"])
            act, stash = split["activation_bytes"][s], split["wgrad_stash_bytes"][s]
            print(f"{count:>6} | {s:>5} | {blocks:>6} | {1e3 * f:>7.3f} | {1e3 * b:>7.3f} | {1e3 * w:>7.3f} | "
                  f"{f'1:{b / f:.2f}:{w / f:.2f}':>14} | {split['p2p_bytes'][s] / 2**20:>9.1f} | {mib(act):>8} | "
                  f"{mib(stash):>9} | {mib(split['static_bytes'][s]):>10}")
    if entry["replays"]:
        print(f"peak memory replayed (MiB above the rank's parameters and main_grads; per rank), "
              f"{entry['replays'][0]['micro_batches']} micro-batches:")
        for r in entry["replays"]:
            label = sim.SCHEDULES[r["schedule"]][2]
            peaks = " / ".join(mib(p) for p in r["peak_bytes"]) if "peak_bytes" in r else f"not run: {r['error']}"
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
    parser.add_argument("--replay-ranks", type=int, nargs="*", default=[2, 4, 8],
                        help="rank counts whose schedules are replayed for their peak memory (none: no replays)")
    parser.add_argument("--replay-micro-batches", type=int, default=16)
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
    replay_cases = [(n, r) for r in args.replay_ranks for n in schedules]
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    payload = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "device": (torch.cuda.get_device_name(0) if device.type == "cuda"
                   else f"cpu, {torch.get_num_threads()} threads"),
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
    failed = {}
    path = os.path.join(args.out, "stage_costs.json")
    for name in models:
        try:
            payload["models"][name] = measure_model(name, args, device, splits, replay_cases, progress)
        except Exception:  # noqa: BLE001 - the other sizes still run; what failed is reported and in the JSON
            failed[name] = traceback.format_exc()
            print(f"\n{name}: FAILED\n{failed[name]}", file=sys.stderr, flush=True)
            payload.setdefault("failed", {})[name] = failed[name]
            try:
                splitgrad.backward_dw_all()  # deferred work of the failed model's stages: let it go
            except Exception:  # noqa: BLE001
                pass
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with open(path, "w") as f:  # after every model: what was measured survives a later failure
            json.dump(payload, f, indent=1)
    progress.close()
    payload["seconds"] = round(time.time() - started, 1)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"stage costs, {payload['date']}, {payload['device']}, torch {payload['torch']}: {payload['timing']} "
          f"over {args.repeats} repeats after {args.warmup} warm-up; B = input gradients, W = deferred weight "
          "gradients; act: held from F to B, stash: held from B to W; static: parameters + fp32 main_grad")
    for name, entry in payload["models"].items():
        print_model(name, entry)
    print(f"\n{path} ({payload['seconds']} s)")
    if failed:
        print(f"FAILED: {', '.join(failed)} (the tracebacks are above and in the JSON)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
