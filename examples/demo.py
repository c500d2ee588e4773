"""splitgrad's main job: zero-bubble pipeline training of a small GPT-style language model on
torch.distributed.pipelining, checked against plain autograd.

One process per pipeline stage (gloo on the CPU by default, NCCL with --device cuda). The model is
built as a Transformer Engine user's GPT is: each block's QKV projection is a
splitgrad.LayerNormLinear (the first norm fused in), its attention output projection a
splitgrad.Linear, its MLP a splitgrad.LayerNormMLP (the second norm fused in, TE's "gelu"); the
output layer is a splitgrad.Linear. All are built with delay_wgrad_compute=True, so a schedule's B
step computes only input gradients (and the norms' gradients) and its W step runs the deferred
weight gradients (splitgrad.pipelining.PipelineStage). The token embedding on the first stage is
tied to the output layer on the last: each holds a copy, and the copies' gradients are summed after
the W steps (splitgrad.pipelining.TiedParameter). With --moe each block's MLP is a top-k routed
mixture of experts instead (tinygpt.MoEMLP): a nn.LayerNorm, a delayed splitgrad.Linear router, and
the experts' fc1 and fc2 as delayed splitgrad.GroupedLinear layers, fed the tokens sorted by expert
and the per-expert counts as an integer tensor on the device (m_splits).

At the end the job prints and checks that the parameters equal those of a single-process
plain-autograd run of the same model in plain PyTorch modules (nn.LayerNorm, nn.Linear, the
activation, one F.linear per expert for --moe; tinygpt.plain_layers) on the same data, measures
each rank's F / B / W intervals, prints the bubble fraction of the chosen schedule next to 1F1B's
(or --compare's), and writes a timeline PNG and a loss-curve PNG.

    python examples/demo.py [--stages 2] [--schedule zb1p] [--compare 1f1b] [--steps 60]
                            [--micro-batches 8] [--model tiny|small|gpt2-medium|1b]
                            [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                            [--moe [--experts 4] [--topk 2]]

--model picks the model's shape (MODELS below); tiny (the default) runs in float32 on the CPU in
seconds, the GPU sizes default to CUDA and bfloat16, one GPU per pipeline rank. In bfloat16 or
float16 the training is Megatron's mixed precision: every parameter accumulates its gradient in an
fp32 ``main_grad`` (the GEMMs' weights and biases of splitgrad modules built with
fuse_wgrad_accumulation=True inside their W step's GEMM; the norms' parameters, as in TE, through
``.grad``) and the optimizer updates fp32 master copies. To measure every stage of a GPU-sized model
on one GPU, in one process: benchmarks/measure_stage_costs.py.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import pipelining
from tqdm import tqdm

import splitgrad
import splitgrad.pipelining as sgp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinygpt  # noqa: E402  (examples/tinygpt.py)

#: --schedule name -> (torch schedule class, stages per rank, stage placement, label)
SCHEDULES = {
    "zb1p": (pipelining.ScheduleInterleavedZeroBubble, 1, "loop", "ZB1P (zero bubble)"),
    "zbv": (pipelining.ScheduleZBVZeroBubble, 2, "v", "ZB-V (zero bubble)"),
    "dualpipev": (pipelining.ScheduleDualPipeV, 2, "v", "DualPipeV"),
    "interleaved-zb": (pipelining.ScheduleInterleavedZeroBubble, 2, "loop", "interleaved ZB1P"),
    "1f1b": (pipelining.Schedule1F1B, 1, "loop", "1F1B"),
    "gpipe": (pipelining.ScheduleGPipe, 1, "loop", "GPipe"),
    "interleaved-1f1b": (pipelining.ScheduleInterleaved1F1B, 2, "loop", "interleaved 1F1B"),
}
SINGLE_STAGE_CLASSES = (pipelining.Schedule1F1B, pipelining.ScheduleGPipe)

#: --model name -> hidden size, attention heads, blocks, context, sequences per micro-batch and the
#: vocabulary (None: the corpus's characters; 50304 is GPT-2's 50257 padded to a multiple of 64, so
#: the embedding and the output layer weigh what a real tokenizer's would; the character ids of the
#: corpus use its first rows). gpt2-medium is GPT-2 medium's shape (355M parameters); small is it
#: with 16 blocks (254M), so that 8 ranks of 2 stages each still get a block per stage; 1b has
#: GPT-3 XL's width and depth at twice GPT-2's context (1.32B). Every GPU size has 4096 tokens per
#: micro-batch.
MODELS = {
    "tiny": dict(dim=128, heads=4, layers=4, context=64, batch=4, vocab=None),
    "small": dict(dim=1024, heads=16, layers=16, context=1024, batch=4, vocab=50304),
    "gpt2-medium": dict(dim=1024, heads=16, layers=24, context=1024, batch=4, vocab=50304),
    "1b": dict(dim=2048, heads=16, layers=24, context=2048, batch=2, vocab=50304),
}
SHAPE_OPTIONS = ("dim", "heads", "layers", "context", "batch")


def resolve_model(args, corpus_vocab: int) -> int:
    """Fills the shape options, --device and --dtype the command line left out from --model's
    preset; returns the vocabulary size."""
    preset = MODELS[args.model]
    for option in SHAPE_OPTIONS:
        if getattr(args, option) is None:
            setattr(args, option, preset[option])
    if args.device is None:
        args.device = "cpu" if args.model == "tiny" else "cuda"
    if args.dtype is None:
        args.dtype = "float32" if args.model == "tiny" else "bfloat16"
    return max(preset["vocab"] or 0, corpus_vocab)


def delayed_layers(device, dtype) -> tinygpt.Layers:
    """The main job's layers: delayed splitgrad modules (LayerNormLinear, Linear, LayerNormMLP,
    GroupedLinear for --moe's experts);
    below float32 their GEMMs add the weight and bias gradients in fp32 into ``main_grad``
    (fuse_wgrad_accumulation), which attach_main_grads sets."""
    kw = dict(params_dtype=dtype, device=device, delay_wgrad_compute=True,
              fuse_wgrad_accumulation=dtype != torch.float32)
    return tinygpt.Layers(
        linear=lambda i, o, bias=True: splitgrad.Linear(i, o, bias, **kw),
        layernorm_linear=lambda i, o: splitgrad.LayerNormLinear(i, o, **kw),
        layernorm_mlp=lambda h, f: splitgrad.LayerNormMLP(h, f, activation=tinygpt.ACTIVATION, **kw),
        grouped_linear=lambda n, i, o: splitgrad.GroupedLinear(n, i, o, **kw),
    )


#: splitgrad's modules; with fuse_wgrad_accumulation, the GEMMs' parameters (all but the norm's,
#: ``layer_norm_*``) get their gradients added to main_grad by the module itself.
SPLITGRAD_MODULES = (splitgrad.Linear, splitgrad.LayerNormLinear, splitgrad.LayerNormMLP, splitgrad.GroupedLinear)


def fused_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters whose gradients ``module``'s splitgrad modules add to main_grad."""
    return {id(p) for layer in module.modules()
            if isinstance(layer, SPLITGRAD_MODULES) and layer.fuse_wgrad_accumulation
            for name, p in layer.named_parameters(recurse=False) if not name.startswith("layer_norm_")}


def attach_main_grads(modules) -> list[nn.Parameter]:
    """Gives every parameter of ``modules`` (each once) an fp32 ``main_grad``. The GEMMs of
    splitgrad modules with fuse_wgrad_accumulation=True add their gradients to it themselves; every
    other parameter's ``.grad`` (embeddings, the norms: also a LayerNormLinear's or LayerNormMLP's
    ``layer_norm_weight``, as in TE) is added to it by a post-accumulate-grad hook and dropped, so
    all gradients accumulate over the micro-batches in fp32 (Megatron's contract). Returns the
    parameters."""
    fused = set().union(*(fused_parameters(m) for m in modules))
    params = list({id(p): p for m in modules for p in m.parameters()}.values())

    def fold(param):
        param.main_grad.add_(param.grad)
        param.grad = None

    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if id(p) not in fused:
            p.register_post_accumulate_grad_hook(fold)
    return params


class MainGradTrainer:
    """SGD (momentum 0.9) on fp32 master copies of low-precision parameters, from their fp32
    ``main_grad`` (attach_main_grads); the step copies the masters back and zeroes the main_grads."""

    def __init__(self, params, lr: float) -> None:
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(self.masters, lr=lr, momentum=0.9)

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            master.grad = p.main_grad
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)
            p.main_grad.zero_()
            master.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def make_trainer(modules, lr: float, dtype):
    """The main job's optimizer: SGD with momentum 0.9, on fp32 masters below float32."""
    if dtype == torch.float32:
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return MainGradTrainer(attach_main_grads(modules), lr)


def micro_batch_problem(name: str, ranks: int, micro_batches: int) -> str | None:
    """Why torch's schedule ``name`` cannot run ``micro_batches`` on ``ranks`` ranks (the checks its
    constructors and schedule generators make, done up front), or None."""
    cls, per_rank, _, label = SCHEDULES[name]
    stages = ranks * per_rank
    fits = None
    if cls in (pipelining.Schedule1F1B, pipelining.ScheduleDualPipeV):
        need = f"at least as many micro-batches as stages ({stages})"
        fits = lambda n: n >= stages  # noqa: E731
    elif cls in (pipelining.ScheduleInterleaved1F1B, pipelining.ScheduleInterleavedZeroBubble):
        need = f"a multiple of its number of rounds, max(1, micro-batches // ranks) = {max(1, micro_batches // ranks)}"
        fits = lambda n: n % max(1, n // ranks) == 0  # noqa: E731
    if fits is None or fits(micro_batches):
        return None
    nearest = min((n for n in range(1, 4 * micro_batches + 4 * stages) if fits(n)),
                  key=lambda n: (abs(n - micro_batches), n))
    return (f"--micro-batches {micro_batches}: {label} on {ranks} ranks needs {need} "
            f"(e.g. --micro-batches {nearest})")


def theoretical_bubble(name: str, ranks: int, micro_batches: int) -> float | None:
    """The bubble fraction with equal F, B and W times t: 1F1B and GPipe idle (p-1)·3t of
    (m+p-1)·3t; ZB-H1, which ZB1P with one stage per rank follows, a third of that idle time."""
    p, m = ranks, micro_batches
    if name in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if name == "zb1p":
        return (p - 1) / (3 * m + p - 1)
    return None


# ------------------------------------------------------------------------------------------------
# One pipeline rank
# ------------------------------------------------------------------------------------------------


def model_shape(args, vocab: int) -> dict:
    """tinygpt.build_pieces's shape arguments."""
    return dict(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, context=args.context,
                seed=args.seed, experts=args.experts if args.moe else 0, topk=args.topk)


def train_pipeline(rank: int, world: int, name: str, steps: int, args, data, vocab, device, dtype):
    """Trains ``steps`` steps under schedule ``name`` on this rank's stages. Returns this rank's
    part of the results: final parameters, losses (last stage), intervals and step windows."""
    cls, per_rank, style, label = SCHEDULES[name]
    num_stages = world * per_rank
    stages_of = lambda r: sgp.stages_of_rank(r, world, per_rank, style)  # noqa: E731
    mine = stages_of(rank)

    pieces = tinygpt.build_pieces(delayed_layers(device, dtype), **model_shape(args, vocab), device=device,
                                  dtype=dtype)
    modules = {s: tinygpt.stage_module(pieces, s, num_stages) for s in mine}
    for s, module in modules.items():
        splitgrad.name_layers(module, prefix=f"stage{s}")
    optimizer = make_trainer(list(modules.values()), args.lr, dtype)  # main_grads before TiedParameter
    stages = [sgp.PipelineStage(modules[s], s, num_stages, device) for s in mine]
    copies = [modules[0].get_submodule("0").tokens.weight] if 0 in modules else []
    if num_stages - 1 in modules:
        copies.append(modules[num_stages - 1].get_submodule(str(len(pieces) - 1)).out.weight)
    first_rank = next(r for r in range(world) if 0 in stages_of(r))
    last_rank = next(r for r in range(world) if num_stages - 1 in stages_of(r))
    tied = sgp.TiedParameter(copies, ranks=[first_rank, last_rank])
    schedule = cls(stages[0] if cls in SINGLE_STAGE_CLASSES else stages,
                   n_microbatches=args.micro_batches, loss_fn=tinygpt.lm_loss)
    timeline = sgp.StageTimeline(device)
    for stage in stages:
        stage.timeline = timeline
    has_first, has_last = 0 in modules, num_stages - 1 in modules
    losses, windows, marks = [], [], []
    show = has_last and rank == last_rank and not args.quiet
    progress = tqdm(range(steps), desc=f"{label:>18} ({world} ranks)", unit="step", disable=not show,
                    mininterval=0.5)
    for step in progress:
        ids, targets = tinygpt.batch(data, step, args.micro_batches * args.batch, args.context, args.seed)
        ids, targets = ids.to(device), targets.to(device)
        step_losses = [] if has_last else None
        marks.append(len(timeline.intervals))
        start = time.perf_counter()
        schedule.step(*((ids,) if has_first else ()), target=targets if has_last else None,
                      losses=step_losses)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        windows.append((start, time.perf_counter()))
        tied.sync_grads()  # both copies of the tied embedding get the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        if has_last:
            loss = torch.stack(step_losses).mean().item()
            losses.append(loss)
            progress.set_postfix(loss=f"{loss:.4f}")
    if splitgrad.pending_wgrads():
        raise RuntimeError(f"rank {rank}: deferred work left after training: {splitgrad.layers_with_pending_wgrads()}")
    marks.append(len(timeline.intervals))
    state = {n: p.detach().float().cpu() for m in modules.values() for n, p in m.named_parameters()}
    intervals = [[(i.stage, i.kind, i.microbatch, i.start, i.end) for i in timeline.intervals[a:b]]
                 for a, b in zip(marks[:-1], marks[1:])]
    return {"params": state, "losses": losses if has_last else None, "intervals": intervals,
            "windows": windows}


def worker(rank: int, world: int, args, out_dir: str) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=f"file://{os.path.join(out_dir, 'init')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=device if backend == "nccl" else None)
    try:
        _, data = tinygpt.load_corpus()
        vocab = args.vocab
        dtype = getattr(torch, args.dtype)
        runs = {}
        for name, steps in [(args.schedule, args.steps)] + [(c, args.timing_steps) for c in args.compare]:
            runs[name] = train_pipeline(rank, world, name, steps, args, data, vocab, device, dtype)
            dist.barrier()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(runs, gathered, dst=0)
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# The reference, the measurements and the report (in the launching process)
# ------------------------------------------------------------------------------------------------


def reference_run(args, data, vocab, device, dtype):
    """The same model in plain PyTorch modules (nn.LayerNorm, nn.Linear, the activation) and plain
    autograd in one process, on the same micro-batches, same optimizer. Returns its parameters under
    TE's names (tinygpt.te_named_parameters) and its losses."""
    pieces = tinygpt.build_pieces(tinygpt.plain_layers(device, dtype), **model_shape(args, vocab), device=device,
                                  dtype=dtype)
    tinygpt.tie(pieces)
    model = nn.Sequential(*pieces)
    optimizer = make_trainer([model], args.lr, dtype)
    losses = []
    for step in tqdm(range(args.steps), desc="    plain autograd (1 process)", unit="step",
                     disable=args.quiet, mininterval=0.5):
        ids, targets = tinygpt.batch(data, step, args.micro_batches * args.batch, args.context, args.seed)
        total = 0.0
        for mb_ids, mb_targets in zip(ids.to(device).chunk(args.micro_batches),
                                      targets.to(device).chunk(args.micro_batches)):
            loss = tinygpt.lm_loss(model(mb_ids), mb_targets)
            (loss / args.micro_batches).backward()
            total += loss.item() / args.micro_batches
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return tinygpt.te_named_parameters(model), losses


def schedule_stats(per_rank_runs, name, args, world):
    """Median step time and bubble fraction over the steps after the first (shape inference and
    warm-up), from every rank's intervals and step windows."""
    runs = [r[name] for r in per_rank_runs]
    steps = len(runs[0]["windows"])
    measured = range(1, steps) if steps > 1 else range(steps)
    bubbles, times = [], []
    for step in measured:
        window = (min(r["windows"][step][0] for r in runs), max(r["windows"][step][1] for r in runs))
        intervals = [[sgp.Interval(*i) for i in r["intervals"][step]] for r in runs]
        bubbles.append(sgp.bubble_fraction(intervals, window))
        times.append(window[1] - window[0])
    step_time = statistics.median(times)
    tokens = args.micro_batches * args.batch * args.context
    return {"bubble": statistics.median(bubbles), "step_ms": 1e3 * step_time, "tokens_per_s": tokens / step_time,
            "theory": theoretical_bubble(name, world, args.micro_batches)}


def write_timeline_plot(path, per_rank_runs, names, world) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colours = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.0 + 0.7 * world * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        runs = [r[name] for r in per_rank_runs]
        step = len(runs[0]["windows"]) - 1  # the last step
        origin = min(r["windows"][step][0] for r in runs)
        for rank, run in enumerate(runs):
            for stage, kind, mb, start, end in run["intervals"][step]:
                nested = kind == "W" and any(k == "B" and s <= start and end <= e
                                             for _, k, _, s, e in run["intervals"][step])
                # a W run inside its full backward (no W actions in the schedule): the B bar's lower half
                y, h = (rank, 0.4) if nested else (rank - 0.4, 0.8)
                ax.broken_barh([(1e3 * (start - origin), 1e3 * (end - start))], (y, h),
                               facecolors=colours[kind], edgecolor="white", linewidth=0.3,
                               zorder=3 if nested else 2)
                if end - start > 0 and not nested:
                    ax.text(1e3 * (start + end) / 2 - 1e3 * origin, rank, str(mb), ha="center", va="center",
                            fontsize=6, color="white")
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        ax.invert_yaxis()
        ax.set_title(f"{SCHEDULES[name][3]}: the last step", fontsize=9)
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, ["F (forward)", "B (input grad)", "W (deferred weight grad)"], loc="upper right",
               fontsize=8, ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_loss_plot(path, losses, reference_losses, label) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, reference_losses, label="plain autograd, 1 process", linewidth=3, alpha=0.5)
    ax.plot(steps, losses, label=f"splitgrad, {label}", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Tied-embedding GPT: pipelined deferred wgrad vs plain autograd")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2, help="pipeline ranks (processes), default 2")
    parser.add_argument("--schedule", default="zb1p", choices=sorted(SCHEDULES))
    parser.add_argument("--compare", default="1f1b",
                        help="comma-separated schedules whose bubble is measured next to it ('' for none)")
    parser.add_argument("--steps", type=int, default=60, help="training steps of --schedule")
    parser.add_argument("--timing-steps", type=int, default=10, help="steps of each --compare schedule")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--model", default="tiny", choices=list(MODELS),
                        help="the model's shape: " + "; ".join(
                            f"{k}: dim {v['dim']}, {v['heads']} heads, {v['layers']} blocks, context "
                            f"{v['context']}, batch {v['batch']}, vocab {v['vocab'] or 'the corpus'}"
                            for k, v in MODELS.items())
                        + ". The options below override it. tiny runs on the CPU in float32, the others on "
                          "CUDA in bfloat16 unless --device / --dtype say otherwise")
    parser.add_argument("--batch", type=int, default=None, help="sequences per micro-batch")
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="below float32: fp32 main_grad (fused in splitgrad's GEMMs) and fp32 master weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true",
                        help="each block's MLP a top-k routed mixture of experts on splitgrad.GroupedLinear")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE block (--moe), default 4")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (--moe), default 2")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest parameter difference accepted (default 1e-5 in float32, 5e-2 otherwise)")
    parser.add_argument("--out", default="out", help="folder for the PNGs")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    tokenizer, data = tinygpt.load_corpus()
    args.vocab = resolve_model(args, tokenizer.vocab_size)
    args.compare = [c for c in args.compare.split(",") if c and c != args.schedule]
    for name in args.compare:
        if name not in SCHEDULES:
            parser.error(f"--compare: unknown schedule {name!r} (choose from {sorted(SCHEDULES)})")
    if args.steps < 1 or args.timing_steps < 1 or args.micro_batches < 1 or args.stages < 2:
        parser.error("--steps, --timing-steps and --micro-batches must be at least 1, --stages at least 2")
    for option in ("batch", "context", "dim", "heads", "layers"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    if args.moe and not 1 <= args.topk <= args.experts:
        parser.error(f"--topk must be between 1 and --experts {args.experts}, got {args.topk}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if args.tolerance is not None and math.isnan(args.tolerance):
        parser.error("--tolerance must be a number, got nan")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {args.out!r}: cannot create the folder ({error.strerror})")
    if not os.access(args.out, os.W_OK):
        parser.error(f"--out {args.out!r}: the folder is not writable")
    if args.dim % args.heads:
        parser.error(f"--heads {args.heads} must divide --dim {args.dim} (each head gets dim / heads features)")
    for name in [args.schedule, *args.compare]:
        problem = micro_batch_problem(name, args.stages, args.micro_batches)
        if problem:
            parser.error(problem)
    if args.context > len(data) - 2:
        parser.error(f"--context {args.context} must be at most {len(data) - 2} "
                     f"(the corpus has {len(data)} characters)")
    if args.device == "cuda" and torch.cuda.device_count() < args.stages:
        parser.error(f"--device cuda needs {args.stages} GPUs (one per pipeline rank), {torch.cuda.device_count()} "
                     "are visible; benchmarks/measure_stage_costs.py measures every stage on one GPU")
    for name in [args.schedule, *args.compare]:
        if args.stages * SCHEDULES[name][1] > args.layers:
            parser.error(f"{name} on {args.stages} ranks has {args.stages * SCHEDULES[name][1]} stages: "
                         f"--layers must be at least that")
    tolerance = args.tolerance if args.tolerance is not None else (1e-5 if args.dtype == "float32" else 5e-2)
    world = args.stages
    dtype = getattr(torch, args.dtype)

    label = SCHEDULES[args.schedule][3]
    print(f"splitgrad main job: {label} on {world} processes ({'NCCL' if args.device == 'cuda' else 'gloo'}), "
          f"model {args.model} (dim {args.dim}, {args.heads} heads, vocab {args.vocab}), "
          f"{args.layers} blocks of delayed splitgrad.LayerNormLinear (QKV), Linear and "
          + (f"a top-{args.topk} MoE of {args.experts} GroupedLinear experts" if args.moe else "LayerNormMLP")
          + f"{' with fp32 main_grad' if args.dtype != 'float32' else ''}, "
          "embedding tied to the output layer across stages, "
          f"{args.micro_batches} micro-batches x {args.batch} x {args.context} tokens, {args.device}, {args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, args, tmp), nprocs=world, join=True)
        per_rank_runs = torch.load(os.path.join(tmp, "result.pt"), weights_only=False)

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    reference, reference_losses = reference_run(args, data, args.vocab, device, dtype)
    main_runs = [r[args.schedule] for r in per_rank_runs]
    losses = next(r["losses"] for r in main_runs if r["losses"] is not None)
    params = {}
    for run in main_runs:
        params.update(run["params"])
    unmatched = sorted(set(params) ^ set(reference))  # every parameter compared, each under one name
    if unmatched:
        print(f"parameters without a twin in the reference or in the pipeline: {unmatched}")
    worst, worst_name = 0.0, ""
    for name, value in params.items():
        if name not in reference:
            continue
        difference = (value - reference[name].detach().float().cpu()).abs().max().item()
        if difference > worst or not math.isfinite(difference):
            worst, worst_name = difference, name
    embedding, output = "0.tokens.weight", f"{args.layers + 1}.out.weight"
    copies_equal = torch.equal(params[embedding], params[output])
    loss_difference = max(abs(a - b) for a, b in zip(losses, reference_losses))

    print()
    header = f"{'':>30} | {'loss, step 1':>12} | {f'loss, step {args.steps}':>13}"
    print(header)
    print("-" * len(header))
    print(f"{'splitgrad, ' + label:>30} | {losses[0]:>12.5f} | {losses[-1]:>13.5f}")
    print(f"{'plain autograd, 1 process':>30} | {reference_losses[0]:>12.5f} | {reference_losses[-1]:>13.5f}")
    print()
    print(f"parameters after {args.steps} steps vs plain autograd: largest difference {worst:.2e} "
          f"({worst_name}; tolerance {tolerance:.0e}); largest loss difference {loss_difference:.2e}")
    print(f"tied embedding: the copies on the first and the last stage are "
          f"{'bit-identical' if copies_equal else 'DIFFERENT'}")

    print()
    header = (f"{'schedule':>18} | {'stages/rank':>11} | {'step (ms)':>9} | {'tokens/s':>9} | "
              f"{'bubble, measured':>16} | {'bubble, theory F=B=W':>20}")
    print(header)
    print("-" * len(header))
    stats = {}
    for name in [args.schedule, *args.compare]:
        s = stats[name] = schedule_stats(per_rank_runs, name, args, world)
        theory = f"{s['theory']:.1%}" if s["theory"] is not None else "-"
        print(f"{SCHEDULES[name][3]:>18} | {SCHEDULES[name][1]:>11} | {s['step_ms']:>9.1f} | "
              f"{s['tokens_per_s']:>9.0f} | {s['bubble']:>16.1%} | {theory:>20}")
    for name in args.compare:
        ratio = stats[args.schedule]["bubble"] / stats[name]["bubble"] if stats[name]["bubble"] > 0 else float("nan")
        speed = stats[name]["step_ms"] / stats[args.schedule]["step_ms"]
        print(f"{label} vs {SCHEDULES[name][3]}: bubble x{ratio:.2f}, throughput x{speed:.2f}")
    print("(bubble: the share of the ranks' step time with no F, B or W running; median over the steps after the first)")

    os.makedirs(args.out, exist_ok=True)
    timeline_png = os.path.join(args.out, "demo_timeline.png")
    loss_png = os.path.join(args.out, "demo_loss.png")
    if write_timeline_plot(timeline_png, per_rank_runs, [args.schedule, *args.compare], world):
        print(f"timeline: {timeline_png}")
    if write_loss_plot(loss_png, losses, reference_losses, label):
        print(f"loss curve: {loss_png}")
    ok = worst <= tolerance and copies_equal and math.isfinite(losses[-1]) and not unmatched
    print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
