"""splitgrad.distributed.GradReducer (mode="all_reduce" and mode="reduce_scatter"), over gloo on the
CPU with 2 and 4 ranks.

Each rank trains on its own data (seeded by rank); the reduced gradients must equal a single-process
plain-autograd run (``to_reference``: nn.Linear twins with the same tying) over all ranks' data
concatenated. In reduce_scatter mode, the ranks' ``sharded_grad`` slices of every parameter are
gathered and concatenated in ``shard_range`` order first (``assert_reduced_match``). Each bucket's
collective must be launched exactly once per step and only after the last contribution to its
parameters: every test runs its steps through a ``Tracker`` that records during which action
(backward, or which layer's backward_dw) each launch happened.

To keep the file fast, one group of processes per world size runs every case in both modes
(``_worker``); a case that fails on any rank fails its test with that rank's traceback.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
import splitgrad.distributed
from spawn_helpers import check_case, run_cases, spawn_and_collect
from sg_helpers import assert_grads_match, named_gradients, to_reference

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this PyTorch build",
)

D = 8
BATCH = 4  # per rank and micro-batch
TINY = 1e-6  # bucket_cap_mb smaller than any parameter: one bucket per parameter
MODES = ("all_reduce", "reduce_scatter")
WORKER_TIMEOUT_S = 240


# ------------------------------------------------------------------------------------------------
# Helpers used inside the workers
# ------------------------------------------------------------------------------------------------


def linear(delay, name, **kw):
    return splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=delay, name=name, **kw)


class Tracker:
    """Runs the actions of a step and records which reducer launches happened during which action."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.launched_during: dict[str, list[str]] = {}  # parameter name -> actions

    def do(self, label, fn):
        before = len(self.reducer.launch_log)
        fn()
        for _, names in self.reducer.launch_log[before:]:
            for name in names:
                self.launched_during.setdefault(name, []).append(label)

    def backward(self, loss):
        self.do("B", loss.backward)

    def backward_dw(self, layer):
        self.do(f"W {layer.name}", layer.backward_dw)


def rank_batches(step, world, n_micro=1, vocab=None):
    """Every rank's inputs and targets for one step: [rank][micro] -> (x, target). Drawn from a
    generator seeded by (step, rank), so any process can rebuild any rank's data."""
    data = []
    for rank in range(world):
        g = torch.Generator().manual_seed(1000 * step + rank)
        micro = []
        for _ in range(n_micro):
            if vocab is None:
                micro.append((torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)))
            else:
                micro.append((torch.randint(vocab, (BATCH, 3), generator=g),
                              torch.randint(vocab, (BATCH, 3), generator=g)))
        data.append(micro)
    return data


def mse(model, x, t, scale=1.0):
    return F.mse_loss(model(x), t) * scale


def reference_step(reference, data, loss_fn):
    """Plain autograd over all ranks' data at once: the mean loss over everything."""
    xs = torch.cat([x for micro in data for x, _ in micro])
    ts = torch.cat([t for micro in data for _, t in micro])
    loss_fn(reference, xs, ts).backward()


def zero_grads(*models):
    for model in models:
        for p in model.parameters():
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()


def assert_reduced_match(model, reference, reducer, world):
    """After finish(), the reduced gradients equal the reference's (plain autograd over all ranks'
    data). all_reduce mode: every parameter's .grad / main_grad. reduce_scatter mode: every rank's
    sharded_grad slices, gathered and concatenated in rank order, whose shard_range's tile the
    flattened parameter. A gradient that is None in the reference must be unreduced here (for
    reduce_scatter: sharded_grad raises)."""
    if reducer.mode == "all_reduce":
        assert_grads_match(model, reference, exact=False)
        return
    mine = {}
    for name, param in model.named_parameters():
        start, stop = reducer.shard_range(param)
        try:
            piece = reducer.sharded_grad(param)
        except RuntimeError:
            piece = None
        else:
            assert piece.dim() == 1 and piece.numel() == stop - start, (name, piece.shape, start, stop)
            bucket = reducer._buckets[reducer._where[id(param)][0]]
            assert piece.untyped_storage().data_ptr() == bucket.shard.untyped_storage().data_ptr()
            piece = piece.clone()
        mine[name] = (start, stop, piece)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)  # every rank gathers before any assertion
    for name, want in named_gradients(reference).items():
        per_rank = [g[name] for g in gathered]
        if want is None:
            assert all(piece is None for _, _, piece in per_rank), f"{name}: reduced, reference has no grad"
            continue
        position = 0
        for rank, (start, stop, piece) in enumerate(per_rank):
            assert piece is not None, f"{name}: rank {rank} has no sharded gradient"
            assert start == position and stop >= start, f"{name}: ranges {[r[:2] for r in per_rank]}"
            position = stop
        assert position == want.numel(), f"{name}: ranges {[r[:2] for r in per_rank]}"
        got = torch.cat([piece for _, _, piece in per_rank]).view_as(want)
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5 * scale,
                                   msg=lambda m: f"{name} (sharded): {m}")


def assert_each_launched_once(reducer, tracker, expected_during):
    """Every parameter's bucket launched exactly once in the step, during the expected action."""
    names = [name for _, names in reducer.launch_log for name in names]
    assert sorted(names) == sorted(expected_during), (names, sorted(expected_during))
    during = {name: actions[0] for name, actions in tracker.launched_during.items()}
    assert during == expected_during, f"launched during {during}, expected {expected_during}"


def tied_model():
    """Two delayed layers sharing one weight, and an untied regular layer."""
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = nn.Sequential(linear(True, "a"), nn.Tanh(), linear(True, "b"), nn.Tanh(), linear(False, "c"))
    model[2].weight = model[0].weight
    return model


# ------------------------------------------------------------------------------------------------
# The cases (run on every rank; they return nothing and raise on failure)
# ------------------------------------------------------------------------------------------------


def case_tied_layers(rank, world, mode):
    """Two tied delayed layers + a regular one, one bucket per parameter, two steps, backward then
    backward_dw in reverse order, then finish(). reduce_scatter: .grad keeps the local gradient."""
    model = tied_model()
    reference = to_reference(model)
    local = to_reference(model)  # plain autograd over this rank's data only
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    assert reducer.buckets == [("4.bias",), ("4.weight",), ("2.bias",), ("0.bias",), ("0.weight",)]
    for step in range(2):
        data = rank_batches(step, world)
        reducer.launch_log.clear()
        tracker = Tracker(reducer)
        x, t = data[rank][0]
        tracker.backward(mse(model, x, t))
        tracker.backward_dw(model[2])
        tracker.backward_dw(model[0])
        reducer.finish()
        # c is regular: ready when the pass ends; b's bias after b's W; the tied weight only after
        # a's W (its second deferred contribution), never after b's
        assert_each_launched_once(reducer, tracker, {
            "4.weight": "B", "4.bias": "B", "2.bias": "W b", "0.bias": "W a", "0.weight": "W a",
        })
        # (within one layer the weight's and the bias's hooks fire in no promised order)
        assert set(reducer.launch_log[:2]) == {(0, ("4.bias",)), (1, ("4.weight",))}
        reference_step(reference, data, mse)
        assert_reduced_match(model, reference, reducer, world)
        if mode == "reduce_scatter":
            reference_step(local, [data[rank]], mse)
            assert_grads_match(model, local, exact=False)  # left unreduced
        zero_grads(model, reference, local)
    reducer.remove()


class MoE(nn.Module):
    """Delayed GroupedLinear experts (routing given per call) and a regular head."""

    def __init__(self):
        super().__init__()
        self.experts = splitgrad.GroupedLinear(3, D, D, device="cpu", delay_wgrad_compute=True,
                                               name="experts")
        self.head = linear(False, "head")

    def forward(self, x, m_splits):
        return self.head(torch.tanh(self.experts(x, m_splits)))


ROUTING = [[2, 0, 2], [0, 4, 0], [1, 1, 2], [4, 0, 0]]  # per rank: experts without rows on some


def case_grouped_experts(rank, world, mode):
    """GradReducer over a GroupedLinear, unchanged: each expert parameter is reduced once, after the
    layer's backward_dw (also an expert that got no rows on this rank), and equals plain autograd
    over all ranks' data, each rank routed its own way."""
    torch.manual_seed(0)
    model = MoE()
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    data = rank_batches(0, world)
    tracker = Tracker(reducer)
    x, t = data[rank][0]
    tracker.backward(F.mse_loss(model(x, ROUTING[rank]), t))
    tracker.backward_dw(model.experts)
    reducer.finish()
    expected = {name: "W experts" for name, _ in model.experts.named_parameters(prefix="experts")}
    expected.update({"head.weight": "B", "head.bias": "B"})
    assert_each_launched_once(reducer, tracker, expected)
    loss = sum(F.mse_loss(reference(micro[0][0], ROUTING[r]), micro[0][1]) for r, micro in enumerate(data))
    (loss / world).backward()
    assert_reduced_match(model, reference, reducer, world)
    reducer.remove()


def case_layernorm_modules(rank, world, mode):
    """A delayed LayerNormLinear (RMSNorm) and LayerNormMLP (swiglu) sharing their norm weight, one
    bucket per parameter, two steps: the GEMMs' parameters reduced once each, after their module's
    backward_dw (buckets in order: the norms' immediate gradients with the buckets before them, the
    shared norm weight after the LayerNormLinear's W); equal to plain autograd over all ranks' data."""
    torch.manual_seed(0)
    model = nn.Sequential(
        splitgrad.LayerNormLinear(D, D, normalization="RMSNorm", device="cpu", delay_wgrad_compute=True,
                                  name="qkv"),
        splitgrad.LayerNormMLP(D, 2 * D, activation="swiglu", device="cpu", delay_wgrad_compute=True, name="mlp"))
    model[1].layer_norm_weight = model[0].layer_norm_weight
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    for step in range(2):
        data = rank_batches(step, world)
        reducer.launch_log.clear()
        tracker = Tracker(reducer)
        x, t = data[rank][0]
        tracker.backward(mse(model, x, t))
        assert reducer.launch_log == []  # the first bucket (fc2_bias) waits for the mlp's W
        tracker.backward_dw(model[1])
        tracker.backward_dw(model[0])
        reducer.finish()
        expected = {f"1.{name}": "W mlp" for name in ("fc2_bias", "fc2_weight", "fc1_bias", "fc1_weight",
                                                       "layer_norm_bias")}
        expected.update({"0.bias": "W qkv", "0.weight": "W qkv", "0.layer_norm_weight": "W qkv"})
        assert_each_launched_once(reducer, tracker, expected)
        reference_step(reference, data, mse)
        assert_reduced_match(model, reference, reducer, world)
        zero_grads(model, reference)
    reducer.remove()


class TiedLM(nn.Module):
    """An embedding tied to a delayed output splitgrad.Linear, with a delayed layer between."""

    def __init__(self, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.mid = linear(True, "mid")
        self.head = splitgrad.Linear(D, vocab, bias=False, device="cpu", delay_wgrad_compute=True,
                                     name="head")
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def lm_loss(model, ids, targets):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def case_tied_embedding(rank, world, mode):
    """nn.Embedding tied to a delayed output layer: the shared weight is reduced once, after the
    head's backward_dw (the embedding's immediate contribution landed during backward) — and, its
    bucket coming after mid's in bucket order, launched with them, during mid's backward_dw."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    data = rank_batches(0, world, vocab=11)
    tracker = Tracker(reducer)
    ids, targets = data[rank][0]
    tracker.backward(lm_loss(model, ids, targets))
    tracker.backward_dw(model.head)
    tracker.backward_dw(model.mid)
    reducer.finish()
    assert_each_launched_once(reducer, tracker, {
        "embed.weight": "W mid", "mid.weight": "W mid", "mid.bias": "W mid",
    })
    reference_step(reference, data, lm_loss)
    assert_reduced_match(model, reference, reducer, world)
    reducer.remove()


def case_main_grad(rank, world, mode):
    """fuse_wgrad_accumulation: the fp32 main_grad is what is reduced (weights; a bias with a
    main_grad too), .grad where the parameter has no main_grad; one bucket for everything."""
    torch.manual_seed(0)
    model = nn.Sequential(linear(True, "a", fuse_wgrad_accumulation=True), nn.Tanh(),
                          linear(True, "b", fuse_wgrad_accumulation=True))
    model[2].weight = model[0].weight
    model[0].weight.main_grad = torch.zeros_like(model[0].weight, dtype=torch.float32)
    model[0].bias.main_grad = torch.zeros_like(model[0].bias, dtype=torch.float32)
    # model[2].bias has no main_grad: its gradient goes to .grad, as in te.Linear
    reference = to_reference(model)
    local = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, mode=mode)  # default cap: a single bucket
    assert reducer.buckets == [("2.bias", "0.bias", "0.weight")]
    for step in range(2):
        data = rank_batches(step, world)
        reducer.launch_log.clear()
        tracker = Tracker(reducer)
        x, t = data[rank][0]
        tracker.backward(mse(model, x, t))
        tracker.backward_dw(model[0])
        tracker.backward_dw(model[2])
        reducer.finish()
        assert_each_launched_once(reducer, tracker, {"2.bias": "W b", "0.bias": "W b", "0.weight": "W b"})
        assert model[0].weight.grad is None and model[0].bias.grad is None
        reference_step(reference, data, mse)
        assert_reduced_match(model, reference, reducer, world)  # main_grad where there is one
        if mode == "reduce_scatter":
            reference_step(local, [data[rank]], mse)
            assert_grads_match(model, local, exact=False)  # main_grad left unreduced
        zero_grads(model, reference, local)
    reducer.remove()


def case_no_sync(rank, world, mode):
    """Two micro-batches, the first inside no_sync(): nothing is launched for it, and the second
    reduces the accumulated gradients."""
    model = tied_model()
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    data = rank_batches(0, world, n_micro=2)
    (x0, t0), (x1, t1) = data[rank]
    with reducer.no_sync():
        mse(model, x0, t0, 0.5).backward()
        model[2].backward_dw()
        model[0].backward_dw()
    assert reducer.launch_log == []
    tracker = Tracker(reducer)
    tracker.backward(mse(model, x1, t1, 0.5))
    tracker.backward_dw(model[2])
    tracker.backward_dw(model[0])
    reducer.finish()
    assert_each_launched_once(reducer, tracker, {
        "4.weight": "B", "4.bias": "B", "2.bias": "W b", "0.bias": "W a", "0.weight": "W a",
    })
    reference_step(reference, data, mse)
    assert_reduced_match(model, reference, reducer, world)
    reducer.remove()


class Skipping(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = linear(True, "a")
        self.skipped = linear(True, "skipped")
        self.c = linear(False, "c")

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)))  # self.skipped is unused on purpose


def case_never_ready(rank, world, mode):
    """A layer left out of the forward: finish() raises naming its parameters, after reducing the
    others."""
    torch.manual_seed(0)
    model = Skipping()
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    data = rank_batches(0, world)
    x, t = data[rank][0]
    mse(model, x, t).backward()
    model.a.backward_dw()
    try:
        reducer.finish()
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("finish() did not raise for parameters that never became ready")
    assert "'skipped.weight', 'skipped.bias'" in message, message
    assert f"Not ready: 'skipped.weight' on {world} of {world} rank(s) (this one among them)" in message, message
    assert "find_unused_parameters=True" in message, message
    assert "'a.weight'" not in message and "'c.weight'" not in message, message
    reference_step(reference, data, mse)
    assert_reduced_match(model, reference, reducer, world)  # the others were reduced; skipped: None
    reducer.remove()


class Optional(nn.Module):
    """``maybe`` is used only where ``use_maybe``; ``never`` (if there) is never used."""

    def __init__(self, with_never=True):
        super().__init__()
        torch.manual_seed(0)
        self.a = linear(True, "a")
        self.maybe = linear(True, "maybe")
        if with_never:
            self.never = linear(True, "never")
        self.c = linear(False, "c")

    def forward(self, x, use_maybe=True):
        h = torch.tanh(self.a(x))
        if use_maybe:
            h = h + torch.tanh(self.maybe(h))
        return self.c(h)


def uses_maybe(rank):
    return rank % 2 == 0  # rank-dependent: the odd ranks skip it


def optional_reference_step(reference, data):
    """Plain autograd of the mean over the ranks of each rank's mean loss, each rank with its own
    structure (what DDP's averaging computes)."""
    world = len(data)
    loss = sum(F.mse_loss(reference(x, uses_maybe(r)), t) for r in range(world) for x, t in data[r]) / world
    loss.backward()


def case_find_unused(rank, world, mode, cap):
    """find_unused_parameters=True with a parameter unused on the odd ranks and one unused on all:
    the reduced gradients equal plain autograd over every rank's data with each rank's structure
    (zero contributions where unused), ``never`` keeps no gradient, as under torch's DDP (compared
    too); two steps, so nothing is left in flight."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Optional()
    reference = to_reference(model)
    ddp = DDP(to_reference(model), find_unused_parameters=True)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=cap, mode=mode, find_unused_parameters=True)
    for step in range(2):
        data = rank_batches(step, world)
        x, t = data[rank][0]
        F.mse_loss(model(x, uses_maybe(rank)), t).backward()
        splitgrad.backward_dw_all()
        reducer.finish()
        optional_reference_step(reference, data)
        assert_reduced_match(model, reference, reducer, world)
        assert model.never.weight.grad is None and reference.never.weight.grad is None
        F.mse_loss(ddp(x, uses_maybe(rank)), t).backward()
        if mode == "all_reduce":
            assert_grads_match(model, ddp.module, exact=False)
        zero_grads(model, reference, ddp.module)
    reducer.remove()


def case_unused_default_refused(rank, world, mode, cap):
    """Without find_unused_parameters, a parameter unused on the odd ranks: finish() raises on every
    rank naming every parameter left unreduced (with a single bucket: all of them), and leaves no
    collective in flight — the next step, with every parameter used, is exact."""
    model = Optional(with_never=False)  # only the rank-dependent unused parameter
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=cap, mode=mode)
    data = rank_batches(0, world)
    x, t = data[rank][0]
    F.mse_loss(model(x, uses_maybe(rank)), t).backward()
    splitgrad.backward_dw_all()
    try:
        reducer.finish()
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("finish() did not raise for a parameter unused on some ranks")
    unreduced = ["a.weight", "a.bias", "maybe.weight", "maybe.bias", "c.weight", "c.bias"] if cap != TINY \
        else ["maybe.weight", "maybe.bias"]
    assert f"{len(unreduced)} parameter(s) were not reduced" in message, message
    assert ", ".join(repr(n) for n in unreduced) + "." in message, message
    here = " (this one among them)" if not uses_maybe(rank) else ""
    assert f"'maybe.weight' on {world // 2} of {world} rank(s){here}" in message, message
    zero_grads(model)
    data = rank_batches(1, world)
    x, t = data[rank][0]
    F.mse_loss(model(x), t).backward()
    splitgrad.backward_dw_all()
    reducer.finish()
    reference_step(reference, data, mse)
    assert_reduced_match(model, reference, reducer, world)
    reducer.remove()


def case_pending_at_finish(rank, world, mode):
    """A backward_dw() forgotten on rank 0 only: finish() raises on every rank naming the layer's
    parameters as pending (even with find_unused_parameters=True: pending is not unused), nothing is
    left in flight, and after running it (in no_sync) the next step is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(linear(True, "l0"), nn.Tanh(), linear(True, "l1"))
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode, find_unused_parameters=True)
    x, t = rank_batches(0, world)[rank][0]
    mse(model, x, t).backward()
    model[2].backward_dw()
    if rank != 0:
        model[0].backward_dw()
    try:
        reducer.finish()
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("finish() did not raise for deferred work pending on rank 0")
    assert "Deferred work is still pending for '0.weight', '0.bias'" in message, message
    assert "2 parameter(s) were not reduced" in message, message
    with reducer.no_sync():
        splitgrad.backward_dw_all()
    zero_grads(model)
    data = rank_batches(1, world)
    x, t = data[rank][0]
    mse(model, x, t).backward()
    splitgrad.backward_dw_all()
    reducer.finish()
    reference_step(reference, data, mse)
    assert_reduced_match(model, reference, reducer, world)
    reducer.remove()


def case_rank_dependent_w_order(rank, world, mode, cap):
    """Each rank runs the backward_dw() calls in its own order (rank 0 last layer first, rank 1 first
    layer first, the others shuffled), one bucket per parameter or a few: the buckets are launched
    in bucket order on every rank whatever the readiness order, so the result is exact."""
    torch.manual_seed(0)
    layers = [linear(True, f"l{i}") for i in range(4)]
    model = nn.Sequential(*layers)
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=cap, mode=mode)
    order = list(reversed(layers)) if rank == 0 else list(layers)
    if rank > 1:
        order = [layers[i] for i in torch.randperm(4, generator=torch.Generator().manual_seed(rank))]
    for step in range(2):
        data = rank_batches(step, world)
        reducer.launch_log.clear()
        x, t = data[rank][0]
        mse(model, x, t).backward()
        for layer in order:
            layer.backward_dw()
        reducer.finish()
        reference_step(reference, data, mse)
        assert_reduced_match(model, reference, reducer, world)
        assert [i for i, _ in reducer.launch_log] == list(range(len(reducer.buckets))), reducer.launch_log
        zero_grads(model, reference)
    reducer.remove()


def case_finish_twice(rank, world, mode):
    """finish() again with no step in between does nothing: no error, the reduced gradients (and
    shards) stand; the next step is exact."""
    model = tied_model()
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    for step in range(2):
        data = rank_batches(step, world)
        x, t = data[rank][0]
        mse(model, x, t).backward()
        splitgrad.backward_dw_all()
        reducer.finish()
        reducer.finish()
        with torch.no_grad():
            model(x)  # an evaluation forward is no step either
        reducer.finish()
        reference_step(reference, data, mse)
        assert_reduced_match(model, reference, reducer, world)
        zero_grads(model, reference)
    reducer.remove()


def case_ready_twice(rank, world, mode):
    """Two backward passes reduced in one step (no no_sync): the second readiness raises."""
    model = tied_model()
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    data = rank_batches(0, world)
    x, t = data[rank][0]
    mse(model, x, t).backward()
    splitgrad.backward_dw_all()
    try:
        mse(model, x, t).backward()  # c's hooks fire at the end of this pass
    except RuntimeError as error:
        assert "became ready twice before finish()" in str(error), str(error)
    else:
        raise AssertionError("a parameter made ready twice did not raise")
    with reducer.no_sync():
        splitgrad.backward_dw_all()  # the work the failed step left queued
    reducer.finish()
    reducer.remove()


def case_overlap(rank, world, mode):
    """One bucket per parameter: the first buckets' all_reduces are launched (and in flight) while
    the later backward_dw() calls still run, before finish()."""
    torch.manual_seed(0)
    layers = [linear(True, f"l{i}") for i in range(4)]
    model = nn.Sequential(*layers)
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=TINY, mode=mode)
    data = rank_batches(0, world)
    x, t = data[rank][0]
    mse(model, x, t).backward()
    assert reducer.launch_log == []  # every layer is delayed: nothing is ready yet
    launched = []
    in_flight = []
    for layer in reversed(layers):
        layer.backward_dw()
        launched.append(len(reducer.launch_log))
        in_flight.append(sum(b.work is not None for b in reducer._buckets))
    assert launched == [2, 4, 6, 8], launched  # grows between backward_dw calls
    assert in_flight == [2, 4, 6, 8], in_flight  # each launch's handle is held until finish()
    assert set(reducer.launch_log[:2]) == {(0, ("3.bias",)), (1, ("3.weight",))}  # the last layer's
    reducer.finish()
    reference_step(reference, data, mse)
    assert_reduced_match(model, reference, reducer, world)
    reducer.remove()


def head_loss(model, x, t):
    return F.mse_loss(model(x), t[:, :3])


def case_several_buckets(rank, world, mode):
    """Buckets of several parameters, one of 63 elements (not a multiple of 2 or 4: padded; with 4
    ranks some parameters lie wholly in other ranks' shards, and parameters straddle shard
    boundaries); two steps reuse the buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(linear(True, "a"), nn.Tanh(),
                          splitgrad.Linear(D, 5, device="cpu", delay_wgrad_compute=True, name="b"), nn.Tanh(),
                          splitgrad.Linear(5, 3, device="cpu", name="c"))
    reference = to_reference(model)
    reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=64 * 4 / 2**20, mode=mode)
    assert reducer.buckets == [("4.bias", "4.weight", "2.bias", "2.weight"), ("0.bias",), ("0.weight",)]
    if mode == "reduce_scatter":
        assert [s.numel() for s in reducer.shards] == [-(-n // world) for n in (63, 8, 64)]
    for step in range(2):
        data = rank_batches(step, world)
        reducer.launch_log.clear()
        tracker = Tracker(reducer)
        x, t = data[rank][0]
        tracker.backward(head_loss(model, x, t))
        tracker.backward_dw(model[2])
        tracker.backward_dw(model[0])
        reducer.finish()
        assert_each_launched_once(reducer, tracker, {
            "4.bias": "W b", "4.weight": "W b", "2.bias": "W b", "2.weight": "W b",
            "0.bias": "W a", "0.weight": "W a",
        })
        reference_step(reference, data, head_loss)
        assert_reduced_match(model, reference, reducer, world)
        zero_grads(model, reference)
    reducer.remove()


def case_mode_accessors(rank, world, mode):
    """The sharded accessors exist only in reduce_scatter mode, and only for the reducer's parameters."""
    model = tied_model()
    reducer = splitgrad.distributed.GradReducer(model, mode=mode)
    try:
        if mode == "all_reduce":
            for call in (lambda: reducer.shards, lambda: reducer.shard_range(model[0].weight),
                         lambda: reducer.sharded_grad(model[0].weight)):
                with pytest.raises(RuntimeError, match="only available with mode='reduce_scatter'"):
                    call()
        else:
            with pytest.raises(ValueError, match="not one of the parameters"):
                reducer.shard_range(torch.zeros(3))
            with pytest.raises(RuntimeError, match="was not reduced in the last step"):
                reducer.sharded_grad(model[0].weight)  # no step has run
    finally:
        reducer.remove()


_CASES = {
    "tied_layers": case_tied_layers,
    "tied_embedding": case_tied_embedding,
    "main_grad": case_main_grad,
    "no_sync": case_no_sync,
    "never_ready": case_never_ready,
    "ready_twice": case_ready_twice,
    "overlap": case_overlap,
    "several_buckets": case_several_buckets,
    "mode_accessors": case_mode_accessors,
    "finish_twice": case_finish_twice,
    "pending_at_finish": case_pending_at_finish,
    "grouped_experts": case_grouped_experts,
    "layernorm_modules": case_layernorm_modules,
}
for _cap, _label in ((TINY, "per_param"), (25, "one_bucket")):
    _CASES[f"w_order_{_label}"] = functools.partial(case_rank_dependent_w_order, cap=_cap)
    _CASES[f"find_unused_{_label}"] = functools.partial(case_find_unused, cap=_cap)
    _CASES[f"unused_refused_{_label}"] = functools.partial(case_unused_default_refused, cap=_cap)
CASES = {f"{name}[{mode}]": functools.partial(case, mode=mode)
         for name, case in _CASES.items() for mode in MODES}


def case_torch_ddp(rank, world):
    """torch's DDP all-reduces from AccumulateGrad's hook, in the backward, before backward_dw():
    a delayed layer it reduces is refused at the forward (naming the layer, nothing queued), and
    allowed inside no_sync(); regular splitgrad layers under DDP get DDP's averaged gradients, as
    their plain-autograd twin under DDP does."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    delayed = nn.Sequential(splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, name="dl"), nn.Tanh())
    ddp = DDP(delayed)
    x = torch.randn(BATCH, D) + rank
    with pytest.raises(RuntimeError, match="splitgrad layer 'dl'.*DistributedDataParallel.*GradReducer"):
        ddp(x)
    assert splitgrad.pending_wgrads() == 0
    with ddp.no_sync():
        ddp(x).sum().backward()
    delayed[0].backward_dw()
    assert delayed[0].weight.grad is not None

    regular = nn.Sequential(splitgrad.Linear(D, D, device="cpu"), nn.Tanh(), splitgrad.Linear(D, D, device="cpu"))
    reference = to_reference(regular)
    ddp_regular, ddp_reference = DDP(regular), DDP(reference)
    ddp_regular(x).pow(2).sum().backward()
    ddp_reference(x).pow(2).sum().backward()
    assert_grads_match(regular, reference, exact=False)


CASES["torch_ddp"] = case_torch_ddp


def _worker(rank, world, init_file, out_dir):
    run_cases(CASES, rank, world, init_file, out_dir, barrier=True)


# ------------------------------------------------------------------------------------------------
# The tests (in the pytest process)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    """Runs every case on ``world`` spawned ranks; returns {case: [traceback or None per rank]}."""
    world = request.param
    return spawn_and_collect(_worker, world, tmp_path_factory.mktemp(f"world{world}"), CASES,
                             WORKER_TIMEOUT_S)


@pytest.mark.parametrize("mode", MODES)
def test_tied_delayed_layers_and_regular_layer(results, mode):
    """Reduced (or reduce-scattered) gradients equal plain autograd over all ranks' data; the tied
    weight's bucket is launched after the second tied layer's backward_dw, each parameter once per
    step; reduce_scatter leaves the local gradient in .grad."""
    check_case(results, f"tied_layers[{mode}]")


def test_torch_ddp_refuses_delayed_layers_and_averages_regular_ones(results):
    check_case(results, "torch_ddp")


@pytest.mark.parametrize("mode", MODES)
def test_grouped_linear_experts(results, mode):
    check_case(results, f"grouped_experts[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_layernorm_linear_and_mlp_sharing_a_norm_weight(results, mode):
    check_case(results, f"layernorm_modules[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_embedding_tied_to_delayed_output_layer(results, mode):
    check_case(results, f"tied_embedding[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_fuse_wgrad_accumulation_main_grad(results, mode):
    check_case(results, f"main_grad[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_no_sync_gradient_accumulation(results, mode):
    check_case(results, f"no_sync[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_finish_names_parameters_never_ready(results, mode):
    check_case(results, f"never_ready[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_ready_twice_without_no_sync_raises(results, mode):
    check_case(results, f"ready_twice[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_collectives_overlap_remaining_backward_dw(results, mode):
    check_case(results, f"overlap[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_several_buckets_padded_shards(results, mode):
    check_case(results, f"several_buckets[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_sharded_accessors_by_mode(results, mode):
    check_case(results, f"mode_accessors[{mode}]")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("buckets", ["per_param", "one_bucket"])
def test_rank_dependent_w_orders_reduce_matching_buckets(results, mode, buckets):
    check_case(results, f"w_order_{buckets}[{mode}]")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("buckets", ["per_param", "one_bucket"])
def test_find_unused_parameters_rank_dependent(results, mode, buckets):
    check_case(results, f"find_unused_{buckets}[{mode}]")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("buckets", ["per_param", "one_bucket"])
def test_unused_on_some_ranks_refused_names_all_unreduced_and_recovers(results, mode, buckets):
    check_case(results, f"unused_refused_{buckets}[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_pending_work_at_finish_refused_on_every_rank(results, mode):
    check_case(results, f"pending_at_finish[{mode}]")


@pytest.mark.parametrize("mode", MODES)
def test_finish_twice_is_a_no_op(results, mode):
    check_case(results, f"finish_twice[{mode}]")


# ------------------------------------------------------------------------------------------------
# Single-process checks (no spawned ranks)
# ------------------------------------------------------------------------------------------------


def test_arguments_checked_and_not_initialized_error():
    model = nn.Sequential(linear(False, "x"))
    with pytest.raises(ValueError, match="mode"):
        splitgrad.distributed.GradReducer(model, mode="broadcast")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        splitgrad.distributed.GradReducer(model, bucket_cap_mb=0)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            splitgrad.distributed.GradReducer(model)


def test_a_reducer_dropped_without_remove_stops_and_is_freed():
    """Hooks hold their reducer weakly: rebinding the name to a new GradReducer over the same model
    leaves one reducer launching collectives, not two (the old one was freed with its hooks)."""
    import gc
    import weakref

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(linear(True, "a"), linear(True, "b"))
        reference = copy.deepcopy(model)
        reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=1e-6)
        old = weakref.ref(reducer)
        for step in range(3):
            if step == 1:
                reducer = splitgrad.distributed.GradReducer(model, bucket_cap_mb=25)  # no remove()
                gc.collect()
                assert old() is None, "the dropped GradReducer is still alive"
            x = torch.randn(4, D)
            model(x).square().sum().backward()
            for layer in reversed(model):
                layer.backward_dw()
            reducer.finish()
            reference(x).square().sum().backward()
            for layer in reversed(reference):
                layer.backward_dw()
            assert len(reducer.launch_log) > 0
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_main_grad_on_every_parameter_gets_the_norms_gradients_too(tmp_path, mode):
    """Megatron's setup: main_grad on every parameter, fused modules. A fused LayerNormLinear /
    LayerNormMLP writes its norm's gradient to .grad (as TE does); the reducer adds it into
    main_grad before reducing, as Megatron's gradient hook does, so no gradient is lost."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            splitgrad.LayerNormLinear(8, 8, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=True),
            splitgrad.LayerNormMLP(8, 16, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=True))
        reference = copy.deepcopy(model)
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False
        reducer = splitgrad.distributed.GradReducer(model, mode=mode)
        x = torch.randn(5, 8)
        model(x).pow(2).sum().backward()
        for layer in model:
            layer.backward_dw()
        reducer.finish()
        for layer in reference:
            layer.fuse_wgrad_accumulation = False
        reference(x).pow(2).sum().backward()
        for layer in reference:
            layer.backward_dw()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            got = p.main_grad if mode == "all_reduce" else reducer.sharded_grad(p)
            torch.testing.assert_close(got.reshape(q.shape), q.grad, msg=name)
            assert p.grad is None, name
    finally:
        dist.destroy_process_group()
