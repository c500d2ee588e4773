"""splitgrad.pipelining: splitgrad layers as the W step of torch.distributed.pipelining's schedules,
over gloo on the CPU with 2 and 4 ranks (one process per rank).

The model is a small language model: a token embedding on the first stage tied to the output layer
on the last (each stage holds its own copy, summed by ``TiedParameter``), and blocks of delayed
splitgrad layers, a regular splitgrad layer, a LayerNorm, and one delayed layer applied twice in a
row (a parameter used at an ancestor and a descendant site of one stage's graph). For every schedule
torch ships — the zero-bubble ones (ZB1P with one and with two stages per rank, ZB-V, DualPipeV) and
the ones without W actions (GPipe, 1F1B, interleaved 1F1B, looped BFS) — one pipeline step's
gradients, and the parameters after an SGD step, must equal a single-process plain-autograd run of
the same model on the same micro-batches. The split schedules are also checked action by action: a
B step leaves the delayed layers' gradients untouched, a W step changes only them, and it runs the
work of the micro-batch the schedule names.

One group of processes per world size runs every case (``_worker``); a case that fails on any rank
fails its test with that rank's traceback.
"""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining

import splitgrad
import splitgrad.pipelining
from sg_helpers import to_reference
from spawn_helpers import check_case, run_cases, spawn_and_collect

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this PyTorch build",
)

VOCAB, D, BLOCKS = 13, 8, 8  # 8 blocks: at least one per stage with 8 stages (4 ranks x 2)
N_MICRO, SEQ_PER_MICRO, TOKENS = 8, 2, 3
LR = 0.1
WORKER_TIMEOUT_S = 300


# ------------------------------------------------------------------------------------------------
# The model, its plain-autograd twin, and how it is cut into stages
# ------------------------------------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)

    def forward(self, ids):
        return self.embed(ids)


class Block(nn.Module):
    """norm -> delayed fc1 -> tanh -> delayed fc2 (+ residual); a regular layer; and a delayed layer
    applied twice in a row (its parameter at an ancestor and a descendant site of the graph). With
    ``fused``, fc1 accumulates into fp32 ``main_grad`` (fuse_wgrad_accumulation)."""

    def __init__(self, linear, fused=False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = linear(D, 2 * D, delay=True, fuse=fused)
        self.fc2 = linear(2 * D, D, delay=True)
        self.regular = linear(D, D, delay=False)
        self.twice = linear(D, D, delay=True)

    def forward(self, x):
        x = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        x = x + 0.5 * torch.tanh(self.regular(x))
        return x + 0.5 * self.twice(torch.tanh(self.twice(x)))


class Head(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.out = linear(D, VOCAB, delay=True, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def splitgrad_linear(i, o, delay, bias=True, fuse=False):
    return splitgrad.Linear(i, o, bias, device="cpu", delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)


def plain_linear(i, o, delay, bias=True, fuse=False):
    return nn.Linear(i, o, bias)


def build_pieces(linear, fused=False):
    """[Embed, Block x BLOCKS, Head], with the same initial values on every rank and for both kinds
    of linear layer; the head's weight starts equal to the embedding's."""
    torch.manual_seed(0)
    pieces = [Embed()] + [Block(linear, fused) for _ in range(BLOCKS)] + [Head(linear)]
    with torch.no_grad():
        pieces[-1].out.weight.copy_(pieces[0].embed.weight)
    return pieces


def reference_model():
    """The whole model in plain autograd, the head tied to the embedding (one Parameter)."""
    pieces = build_pieces(plain_linear)
    pieces[-1].out.weight = pieces[0].embed.weight
    return nn.Sequential(*pieces)


def stage_module(pieces, stage, num_stages):
    """Stage ``stage``'s part of the model: blocks spread evenly, the embedding on the first stage,
    the head on the last. Returns the module and the names of its parameters in the reference."""
    per_stage = [BLOCKS // num_stages + (1 if s < BLOCKS % num_stages else 0) for s in range(num_stages)]
    first = 1 + sum(per_stage[:stage])
    indices = list(range(first, first + per_stage[stage]))
    if stage == 0:
        indices = [0] + indices
    if stage == num_stages - 1:
        indices = indices + [len(pieces) - 1]
    module = nn.Sequential()
    names = {}
    for i in indices:
        module.add_module(str(i), copy.deepcopy(pieces[i]))
    for name, _ in module.named_parameters():
        names[name] = name  # the stage's Sequential keeps the reference's indices as names
    splitgrad.name_layers(module, prefix=f"stage{stage}")
    return module, names


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def step_data(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(VOCAB, (N_MICRO * SEQ_PER_MICRO, TOKENS), generator=g)
    targets = torch.randint(VOCAB, (N_MICRO * SEQ_PER_MICRO, TOKENS), generator=g)
    return ids, targets


def reference_step(reference, ids, targets):
    """Plain autograd over the same micro-batches: mean of the micro-batch losses (the schedule
    scales the summed gradients by 1 / N_MICRO)."""
    for mb_ids, mb_targets in zip(ids.chunk(N_MICRO), targets.chunk(N_MICRO)):
        (lm_loss(reference(mb_ids), mb_targets) / N_MICRO).backward()


# ------------------------------------------------------------------------------------------------
# Schedules
# ------------------------------------------------------------------------------------------------

P = pipelining

#: name -> (schedule class, stages per rank, stage placement)
SCHEDULES = {
    "GPipe": (P.ScheduleGPipe, 1, "loop"),
    "1F1B": (P.Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (P.ScheduleInterleaved1F1B, 2, "loop"),
    "LoopedBFS": (P.ScheduleLoopedBFS, 2, "loop"),
    "ZB1P": (P.ScheduleInterleavedZeroBubble, 1, "loop"),
    "InterleavedZB1P": (P.ScheduleInterleavedZeroBubble, 2, "loop"),
    "ZBV": (P.ScheduleZBVZeroBubble, 2, "v"),
    "DualPipeV": (P.ScheduleDualPipeV, 2, "v"),
}
SPLIT_SCHEDULES = ("ZB1P", "InterleavedZB1P", "ZBV", "DualPipeV")


def gradient_of(param):
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class Recorder:
    """Wraps a stage's B and W steps and checks, action by action, what each one changed: a B step
    of a split schedule (an "I" action) leaves the delayed layers' gradients as they were and queues
    one backward pass for each; a W step changes only their gradients and runs exactly the pass that
    its micro-batch's B step queued. Also logs during which action each grad-ready hook fired."""

    def __init__(self, stage):
        self.stage = stage
        self.actions = []
        self.current = None  # the action running now
        self.params = dict(stage.submod.named_parameters())
        self.delayed_names = {name for name, p in self.params.items()
                              if any(p is q for layer in stage.delayed_layers for q in (layer.weight, layer.bias))}
        self.queued_by = {}  # micro-batch -> {layer name: the pass its B step queued}
        self.hook_log = []  # (parameter name, action kind) per grad-ready hook call
        self.handles = [splitgrad.register_grad_ready_hook(p, functools.partial(self._ready, name))
                        for name, p in self.params.items()]
        for method in ("backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, method, self._wrap(method, getattr(stage, method)))

    def _ready(self, name, _param):
        self.hook_log.append((name, self.current))

    def _snapshot(self):
        return {name: (None if gradient_of(p) is None else gradient_of(p).clone()) for name, p in self.params.items()}

    def _changed(self, before):
        after = self._snapshot()
        return {name for name in after
                if (before[name] is None) != (after[name] is None)
                or (after[name] is not None and not torch.equal(before[name], after[name]))}

    def _passes(self):
        return {layer.name: set(layer._layer.pending_passes()) for layer in self.stage.delayed_layers}

    def _wrap(self, method, fn):
        def wrapped(chunk, *args, **kwargs):
            if method == "backward_one_chunk":
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                kind = "B" if full else "I"
            else:
                kind = "W"
            passes_before, before = self._passes(), self._snapshot()
            self.current = kind
            try:
                result = fn(chunk, *args, **kwargs)
            finally:
                self.current = None
            changed, passes_after = self._changed(before), self._passes()
            if kind == "I":
                assert not (changed & self.delayed_names), (
                    f"I step of micro-batch {chunk} changed delayed gradients {sorted(changed & self.delayed_names)}")
                queued = {name: passes_after[name] - passes_before[name] for name in passes_after}
                assert all(len(q) == 1 for q in queued.values()), f"I step of {chunk} queued {queued}"
                self.queued_by[chunk] = {name: q.pop() for name, q in queued.items()}
            elif kind == "W":
                assert changed and changed <= self.delayed_names, (
                    f"W step of micro-batch {chunk} changed {sorted(changed)}; expected only delayed "
                    f"gradients {sorted(self.delayed_names)}")
                for name, pass_id in self.queued_by.pop(chunk).items():
                    ran = passes_before[name] - passes_after[name]
                    assert ran == {pass_id}, (
                        f"W of micro-batch {chunk} ran passes {ran} of layer {name}; its B queued {pass_id}")
            else:
                assert passes_after == passes_before, "a full backward left deferred work queued"
            self.actions.append((kind, chunk))
            return result

        return wrapped

    def check_hooks(self):
        """Each parameter's grad-ready hook fired once per micro-batch, after its last contribution:
        a delayed layer's during the W step (or the full backward "B", where a schedule does not split
        it: DualPipeV splits only some), every other one's during the backward ("I" or "B")."""
        for name in self.params:
            kinds = [kind for n, kind in self.hook_log if n == name]
            allowed = {"W", "B"} if name in self.delayed_names else {"I", "B"}
            assert len(kinds) == N_MICRO and set(kinds) <= allowed, (
                f"{name}: grad-ready hooks fired during {kinds}, expected {N_MICRO} in {sorted(allowed)}")
        self.hook_log.clear()


def build_pipeline(rank, world, name, fused=False):
    """This rank's stages of schedule ``name``, their modules, the schedule and the tied embedding."""
    cls, per_rank, placement = SCHEDULES[name]
    num_stages = world * per_rank
    pieces = build_pieces(splitgrad_linear, fused)
    stages_of_rank = functools.partial(splitgrad.pipelining.stages_of_rank, world=world,
                                       stages_per_rank=per_rank, style=placement)
    my_stages = stages_of_rank(rank)
    last_rank = next(r for r in range(world) if num_stages - 1 in stages_of_rank(r))
    modules = {s: stage_module(pieces, s, num_stages)[0] for s in my_stages}
    if fused:
        for module in modules.values():
            for layer in module.modules():
                if isinstance(layer, splitgrad.Linear) and layer.fuse_wgrad_accumulation:
                    for p in (layer.weight, layer.bias):
                        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    stages = [splitgrad.pipelining.PipelineStage(modules[s], s, num_stages, "cpu") for s in my_stages]
    copies = [m.get_submodule("0").embed.weight for s, m in modules.items() if s == 0]
    copies += [m.get_submodule(str(BLOCKS + 1)).out.weight for s, m in modules.items() if s == num_stages - 1]
    tied = splitgrad.pipelining.TiedParameter(copies, ranks=[0, last_rank])
    single = cls in (P.ScheduleGPipe, P.Schedule1F1B)
    schedule = cls(stages[0] if single else stages, n_microbatches=N_MICRO, loss_fn=lm_loss)
    return modules, stages, schedule, tied


def pipeline_step(schedule, modules, step, num_stages):
    """One schedule step on this rank's share of the data; the last stage's losses (or None)."""
    ids, targets = step_data(step)
    has_first, has_last = 0 in modules, num_stages - 1 in modules
    losses = [] if has_last else None
    schedule.step(*((ids,) if has_first else ()), target=targets if has_last else None, losses=losses)
    return losses


def assert_grads_equal_reference(modules, ref_params, what):
    for s, module in modules.items():
        for pname, p in module.named_parameters():
            got = gradient_of(p)
            assert got is not None, f"{what}: stage {s} {pname} has no gradient"
            torch.testing.assert_close(got, ref_params[pname].grad.to(got.dtype), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: stage {s} {pname}: {m}")


def run_schedule(rank, world, name, fused=False, steps=2):
    """``steps`` pipeline steps with schedule ``name``: after each, the gradients (after the tied
    copies are summed) and the parameters after an SGD step equal the plain-autograd reference's,
    the losses too; every action did what it should (Recorder) and every grad-ready hook fired once
    per micro-batch."""
    cls, per_rank, _ = SCHEDULES[name]
    num_stages = world * per_rank
    modules, stages, schedule, tied = build_pipeline(rank, world, name, fused)
    recorders = [Recorder(stage) for stage in stages]
    timeline = splitgrad.pipelining.StageTimeline()
    for stage in stages:
        stage.timeline = timeline
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    reference = reference_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))

    for step in range(steps):
        losses = pipeline_step(schedule, modules, step, num_stages)
        assert splitgrad.pending_wgrads() == 0, splitgrad.layers_with_pending_wgrads()
        tied.sync_grads()
        ids, targets = step_data(step)
        if losses is not None:
            with torch.no_grad():
                want = [lm_loss(reference(i), t) for i, t in zip(ids.chunk(N_MICRO), targets.chunk(N_MICRO))]
            torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-5, atol=1e-6)
        reference_step(reference, ids, targets)
        assert_grads_equal_reference(modules, ref_params, f"{name} step {step}")
        for recorder in recorders:
            recorder.check_hooks()
        for p in params:  # Megatron's optimizer reads main_grad
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.clone()
        optimizer.step()
        ref_optimizer.step()
        for s, module in modules.items():
            for pname, p in module.named_parameters():
                torch.testing.assert_close(p.detach(), ref_params[pname].detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} parameters after step {step}, stage {s} {pname}: {m}")
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        for p in params:
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
    kinds = {k for r in recorders for k, _ in r.actions}
    if name in SPLIT_SCHEDULES:
        assert {"I", "W"} <= kinds, kinds  # DualPipeV also runs full backwards
    else:
        assert kinds == {"B"}, kinds
    for r in recorders:
        assert not r.queued_by, f"B steps without their W: {r.queued_by}"
    check_timeline(timeline, stages, steps)
    dist.barrier()


def check_timeline(timeline, stages, steps):
    """Every stage recorded, per step and micro-batch, one F, one B and one W, in that order (a W
    inside its full backward where the schedule does not split it)."""
    for stage in stages:
        mine = [i for i in timeline.intervals if i.stage == stage.stage_index]
        for kind in "FBW":
            chunks = sorted(i.microbatch for i in mine if i.kind == kind)
            assert chunks == sorted(list(range(N_MICRO)) * steps), (stage.stage_index, kind, chunks)
        for interval in mine:
            assert interval.start <= interval.end, interval
        for chunk in range(N_MICRO):
            f, b, w = ([i for i in mine if i.kind == k and i.microbatch == chunk][-1] for k in "FBW")
            assert f.end <= b.start and b.start <= w.start, (f, b, w)


def case_leftover_work(rank, world):
    """A schedule that skips one micro-batch's W step: the step ends in a PendingWgradError naming
    the micro-batch and the layers; the next step refuses to start while the work is queued; nothing
    is lost: backward_dw_all() runs it, and then the gradients equal the reference's."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank its own one-stage pipeline
    pieces = build_pieces(splitgrad_linear)
    module = stage_module(pieces, 0, 1)[0]
    stage = splitgrad.pipelining.PipelineStage(module, 0, 1, "cpu", group=groups[rank])
    schedule = P.ScheduleInterleavedZeroBubble([stage], n_microbatches=N_MICRO, loss_fn=lm_loss)
    skipped = 3
    run_w = stage.backward_weight_one_chunk

    def forgetful_w(chunk, *args, **kwargs):
        if chunk != skipped:
            return run_w(chunk, *args, **kwargs)

    stage.backward_weight_one_chunk = forgetful_w
    ids, targets = step_data(rank)
    try:
        schedule.step(ids, target=targets)
    except splitgrad.PendingWgradError as error:
        message = str(error)
    else:
        raise AssertionError("a step with a W step missing raised nothing")
    assert f"micro-batch(es) [{skipped}]" in message, message
    assert "'stage0.1.fc1'" in message and "'stage0.9.out'" in message, message
    assert splitgrad.pending_wgrads() > 0, "the skipped micro-batch's work must stay queued"
    fresh = P.ScheduleInterleavedZeroBubble([stage], n_microbatches=N_MICRO, loss_fn=lm_loss)
    try:
        fresh.step(ids, target=targets)
    except splitgrad.PendingWgradError as error:
        assert "when the next step started" in str(error) and f"[{skipped}]" in str(error), str(error)
    else:
        raise AssertionError("a step started with the last step's work still queued")

    splitgrad.backward_dw_all()  # the caller recovers the lost W step: nothing was lost
    stage.scale_grads(N_MICRO)  # what the failed step did not get to
    embed, head = module.get_submodule("0").embed.weight, module.get_submodule(str(BLOCKS + 1)).out.weight
    tied = splitgrad.pipelining.TiedParameter([embed, head], ranks=[rank])
    tied.sync_grads()
    reference = reference_model()
    reference_step(reference, ids, targets)
    assert_grads_equal_reference({0: module}, dict(reference.named_parameters(remove_duplicate=False)),
                                 "after recovering the skipped W step")
    stage.check_no_pending_work()  # nothing is owed any more
    dist.barrier()


def case_second_stage(rank, world):
    """A second PipelineStage over the same modules (another schedule, half the micro-batches),
    while the first is alive, then the first again, then a third after the first two are deleted:
    every step's gradients equal plain autograd (torch's own PipelineStage allows this), and a
    deleted stage is freed (its dw_builder does not keep it alive)."""
    import gc
    import weakref

    name = "ZB1P"
    cls, per_rank, _ = SCHEDULES[name]
    num_stages = world * per_rank
    modules, stages, schedule, tied = build_pipeline(rank, world, name)
    reference = reference_model()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))

    def new_schedule(n_micro):
        mine = [splitgrad.pipelining.PipelineStage(modules[s], s, num_stages, "cpu") for s in modules]
        return mine, cls(mine, n_microbatches=n_micro, loss_fn=lm_loss)

    def check_step(sched, step, what):
        pipeline_step(sched, modules, step, num_stages)
        tied.sync_grads()
        reference_step(reference, *step_data(step))  # equal micro-batches: any count gives one mean
        assert_grads_equal_reference(modules, ref_params, what)
        for p in [p for m in modules.values() for p in m.parameters()] + list(reference.parameters()):
            p.grad = None

    check_step(schedule, 0, "first stage")
    second, second_schedule = new_schedule(N_MICRO // 2)
    check_step(second_schedule, 1, "second stage, the first alive")
    check_step(schedule, 2, "the first stage again")
    gone = [weakref.ref(stage) for stage in stages + second]
    del stages, schedule, second, second_schedule
    gc.collect()
    assert all(ref() is None for ref in gone), "a deleted stage is still alive"
    _, third_schedule = new_schedule(N_MICRO)
    check_step(third_schedule, 3, "a third stage after the first two were deleted")
    dist.barrier()


def case_tied_parameter_checks(rank, world):
    """TiedParameter compares its copies across the ranks in its constructor: (3, 4) against (4, 3),
    (3, 4) against (3, 5), float32 against bfloat16, and ranks lists that differ, each raise a
    ValueError on every rank naming both; nothing is left in flight (a matching tie then sums)."""
    holders = [0, world - 1]
    cases = [((3, 4), torch.float32, (4, 3), torch.float32, "rank 0 holds shape (3, 4) torch.float32; "
              f"rank {world - 1} holds shape (4, 3) torch.float32"),
             ((3, 4), torch.float32, (3, 5), torch.float32, f"rank {world - 1} holds shape (3, 5)"),
             ((3, 4), torch.float32, (3, 4), torch.bfloat16, f"rank {world - 1} holds shape (3, 4) torch.bfloat16")]
    for first, first_dtype, last, last_dtype, expected in cases:
        copies = []
        if rank == 0:
            copies = [torch.zeros(first, dtype=first_dtype, requires_grad=True)]
        elif rank == world - 1:
            copies = [torch.zeros(last, dtype=last_dtype, requires_grad=True)]
        try:
            splitgrad.pipelining.TiedParameter(copies, ranks=holders)
        except ValueError as error:
            assert "one shape and one gradient dtype" in str(error) and expected in str(error), str(error)
        else:
            raise AssertionError(f"TiedParameter accepted {first} {first_dtype} against {last} {last_dtype}")
    copies = [nn.Parameter(torch.zeros(3, 4))] if rank in holders else []
    if world > 2:  # (with 2 ranks there is no other list of two or more)
        try:
            splitgrad.pipelining.TiedParameter(copies, ranks=holders if rank else [0, 1, world - 1])
        except ValueError as error:
            assert "every rank must pass the same ranks" in str(error) and "[0, 1, 3]" in str(error), str(error)
        else:
            raise AssertionError("TiedParameter accepted ranks that differ between the ranks")
    tied = splitgrad.pipelining.TiedParameter(copies, ranks=holders)
    for copy in copies:
        copy.grad = torch.full((3, 4), float(rank + 1))
    tied.sync_grads()
    for copy in copies:
        torch.testing.assert_close(copy.grad, torch.full((3, 4), float(1 + world)), rtol=0, atol=0)
    dist.barrier()


# ------------------------------------------------------------------------------------------------
# The worker
# ------------------------------------------------------------------------------------------------

class MoEBlock(nn.Module):
    """norm -> delayed GroupedLinear experts (fixed routing: 6 rows a micro-batch, expert 1 gets
    none) -> tanh, + residual."""

    ROUTE = [4, 0, 2]

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.experts = splitgrad.GroupedLinear(3, D, D, device="cpu", delay_wgrad_compute=True)

    def forward(self, x):
        return x + torch.tanh(self.experts(self.norm(x), self.ROUTE))


def case_grouped_experts(rank, world):
    """ZB1P over stages of GroupedLinear experts: each W step runs its micro-batch's grouped items
    (the stage finds GroupedLinear among its delayed layers); gradients equal plain autograd's."""
    torch.manual_seed(0)
    pieces = [Embed()] + [MoEBlock() for _ in range(BLOCKS)] + [Head(splitgrad_linear)]
    reference = to_reference(nn.Sequential(*pieces))
    ref_params = dict(reference.named_parameters())
    module = stage_module(pieces, rank, world)[0]
    stage = splitgrad.pipelining.PipelineStage(module, rank, world, "cpu")
    assert any(isinstance(layer, splitgrad.GroupedLinear) for layer in stage.delayed_layers)
    schedule = P.ScheduleInterleavedZeroBubble([stage], n_microbatches=N_MICRO, loss_fn=lm_loss)
    stage.timeline = splitgrad.pipelining.StageTimeline()
    pipeline_step(schedule, {rank: module}, 0, world)
    assert splitgrad.pending_wgrads() == 0, splitgrad.layers_with_pending_wgrads()
    check_timeline(stage.timeline, [stage], 1)  # one F, B and W per micro-batch, in that order
    reference_step(reference, *step_data(0))
    assert_grads_equal_reference({rank: module}, ref_params, "grouped experts")
    dist.barrier()


class LayerNormBlock(nn.Module):
    """A TE-style block: a delayed LayerNormLinear (RMSNorm) and a delayed LayerNormMLP (swiglu),
    each with a residual."""

    def __init__(self):
        super().__init__()
        self.qkv = splitgrad.LayerNormLinear(D, D, normalization="RMSNorm", device="cpu", delay_wgrad_compute=True)
        self.mlp = splitgrad.LayerNormMLP(D, 2 * D, activation="swiglu", device="cpu", delay_wgrad_compute=True)

    def forward(self, x):
        x = x + torch.tanh(self.qkv(x))
        return x + self.mlp(x)


def case_layernorm_modules(rank, world):
    """ZB1P over stages of LayerNormLinear / LayerNormMLP blocks: each W step runs its micro-batch's
    work of both modules (fc2's and fc1's for the MLP), the norms' gradients land in B; gradients
    equal plain autograd's."""
    torch.manual_seed(0)
    pieces = [Embed()] + [LayerNormBlock() for _ in range(BLOCKS)] + [Head(splitgrad_linear)]
    reference = to_reference(nn.Sequential(*pieces))
    ref_params = dict(reference.named_parameters())
    module = stage_module(pieces, rank, world)[0]
    stage = splitgrad.pipelining.PipelineStage(module, rank, world, "cpu")
    kinds = {type(layer) for layer in stage.delayed_layers}
    assert {splitgrad.LayerNormLinear, splitgrad.LayerNormMLP} <= kinds, kinds
    schedule = P.ScheduleInterleavedZeroBubble([stage], n_microbatches=N_MICRO, loss_fn=lm_loss)
    stage.timeline = splitgrad.pipelining.StageTimeline()
    pipeline_step(schedule, {rank: module}, 0, world)
    assert splitgrad.pending_wgrads() == 0, splitgrad.layers_with_pending_wgrads()
    check_timeline(stage.timeline, [stage], 1)
    reference_step(reference, *step_data(0))
    assert_grads_equal_reference({rank: module}, ref_params, "LayerNorm modules")
    dist.barrier()


def case_grad_reducer_and_scale_grads(rank, world):
    """Data parallelism around a pipeline stage: a GradReducer over the stage's parameters
    (passes_per_step = the micro-batches) under a schedule that divides the gradients by the
    micro-batches (scale_grads=True, torch's default). The stage hands that division to the
    reducer, which applies it to the reduced sums in finish() (a division of the local gradients
    would be undone by finish()'s write-back of the sums it took before): the gradients written
    back (all_reduce) or sharded (reduce_scatter) are the ranks' average of plain autograd's."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank its own one-stage pipeline
    ids, targets = step_data(rank)
    reference = reference_model()
    reference_step(reference, ids, targets)
    everyone = [None] * world
    dist.all_gather_object(everyone, {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)})
    averaged = {n: types.SimpleNamespace(grad=sum(grads[n] for grads in everyone) / world) for n in everyone[0]}
    for mode in ("all_reduce", "reduce_scatter"):
        module = stage_module(build_pieces(splitgrad_linear), 0, 1)[0]
        stage = splitgrad.pipelining.PipelineStage(module, 0, 1, "cpu", group=groups[rank])
        reducer = splitgrad.distributed.GradReducer(module, mode=mode, passes_per_step=N_MICRO)
        P.ScheduleInterleavedZeroBubble([stage], n_microbatches=N_MICRO, loss_fn=lm_loss).step(ids, target=targets)
        reducer.finish()
        embed, head = module.get_submodule("0").embed.weight, module.get_submodule(str(BLOCKS + 1)).out.weight
        if mode == "all_reduce":
            splitgrad.pipelining.TiedParameter([embed, head], ranks=[rank]).sync_grads()
            assert_grads_equal_reference({0: module}, averaged, f"GradReducer ({mode}) around a stage")
        else:
            for name, param in module.named_parameters():
                if param is embed or param is head:
                    continue  # each tied copy's own share of the tied gradient: not in the reference
                start, stop = reducer.shard_range(param)
                torch.testing.assert_close(reducer.sharded_grad(param),
                                           averaged[name].grad.flatten()[start:stop], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"GradReducer ({mode}) around a stage: {name}: {m}")
        reducer.remove()
    dist.barrier()


CASES = {f"schedule[{name}]": functools.partial(run_schedule, name=name) for name in SCHEDULES}
CASES["schedule[ZB1P-main_grad]"] = functools.partial(run_schedule, name="ZB1P", fused=True)
CASES["schedule[ZBV-main_grad]"] = functools.partial(run_schedule, name="ZBV", fused=True)
CASES["leftover_work"] = case_leftover_work
CASES["second_stage"] = case_second_stage
CASES["tied_parameter_checks"] = case_tied_parameter_checks
CASES["grouped_experts"] = case_grouped_experts
CASES["layernorm_modules"] = case_layernorm_modules
CASES["grad_reducer_and_scale_grads"] = case_grad_reducer_and_scale_grads


def _worker(rank, world, init_file, out_dir):
    run_cases(CASES, rank, world, init_file, out_dir, barrier=False)


# ------------------------------------------------------------------------------------------------
# The tests (in the pytest process)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    """Runs every case on ``world`` spawned ranks; returns {case: [traceback or None per rank]}."""
    world = request.param
    return spawn_and_collect(_worker, world, tmp_path_factory.mktemp(f"pipeline{world}"), CASES,
                             WORKER_TIMEOUT_S)


@pytest.mark.parametrize("schedule", list(SCHEDULES) + ["ZB1P-main_grad", "ZBV-main_grad"])
def test_schedule_matches_plain_autograd(results, schedule):
    """Gradients, losses and parameters after SGD steps equal single-process plain autograd, tied
    embedding included; B steps compute no delayed weight gradient, each W step runs exactly its
    micro-batch's deferred work, grad-ready hooks fire once per micro-batch after the last
    contribution, and the timeline holds one F, B and W per micro-batch."""
    check_case(results, f"schedule[{schedule}]")


def test_leftover_deferred_work_is_an_error_and_nothing_is_lost(results):
    check_case(results, "leftover_work")


def test_grouped_linear_experts_under_zero_bubble(results):
    check_case(results, "grouped_experts")


def test_layernorm_modules_under_zero_bubble(results):
    check_case(results, "layernorm_modules")


def test_second_stage_over_the_same_module(results):
    check_case(results, "second_stage")


def test_tied_parameter_compares_copies_across_ranks(results):
    check_case(results, "tied_parameter_checks")


def test_grad_reducer_around_a_stage_takes_the_schedules_scaling(results):
    check_case(results, "grad_reducer_and_scale_grads")


# ------------------------------------------------------------------------------------------------
# Single-process checks (no spawned ranks)
# ------------------------------------------------------------------------------------------------


def test_busy_time_and_bubble_fraction():
    Interval = splitgrad.pipelining.Interval
    # rank 0 busy on [0, 4) with a W nested inside a B; rank 1 busy on [1, 2) and [3, 4)
    rank0 = [Interval(0, "F", 0, 0.0, 1.0), Interval(0, "B", 0, 1.0, 4.0), Interval(0, "W", 0, 2.0, 3.0)]
    rank1 = [Interval(1, "F", 0, 1.0, 2.0), Interval(1, "B", 0, 3.0, 4.0)]
    assert splitgrad.pipelining.busy_time(rank0) == 4.0  # the nested W counts once
    assert splitgrad.pipelining.busy_time(rank1) == 2.0
    assert splitgrad.pipelining.bubble_fraction([rank0, rank1]) == pytest.approx(1 - 6 / 8)
    assert splitgrad.pipelining.bubble_fraction([rank0], window=(0.0, 8.0)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no intervals"):
        splitgrad.pipelining.bubble_fraction([[], []])
    with pytest.raises(ValueError, match="positive length"):
        splitgrad.pipelining.bubble_fraction([rank0], window=(1.0, 1.0))


def test_stages_of_rank_follows_torchs_placement():
    stages_of_rank = splitgrad.pipelining.stages_of_rank
    assert [stages_of_rank(r, 4) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stages_of_rank(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stages_of_rank(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # torch's own mapping for the V schedules
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping
    mapping = generate_stage_to_rank_mapping(4, 8, style="v")
    assert all(mapping[s] == r for r in range(4) for s in stages_of_rank(r, 4, 2, "v"))
    mapping = generate_stage_to_rank_mapping(2, 4, style="loop")
    assert all(mapping[s] == r for r in range(2) for s in stages_of_rank(r, 2, 2))
    with pytest.raises(ValueError, match="style"):
        stages_of_rank(0, 2, 2, "zigzag")
    with pytest.raises(ValueError, match="2 stages per rank"):
        stages_of_rank(0, 2, 3, "v")
    with pytest.raises(ValueError, match="rank 2, world 2"):
        stages_of_rank(2, 2)


def test_stage_and_tied_parameter_argument_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        splitgrad.pipelining.PipelineStage(lambda x: x, 0, 1, "cpu")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            splitgrad.pipelining.TiedParameter([nn.Parameter(torch.zeros(2))], ranks=[0])
