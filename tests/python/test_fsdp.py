"""splitgrad layers under FSDP2 (``splitgrad.distributed.fully_shard``, torch's ``fully_shard`` with the
reduce-scatter of deferred gradients moved to the last ``backward_dw()``), over gloo on the CPU with
2 and 4 ranks, each with its own data.

After a step the sharded gradients (gathered with ``full_tensor()``) and the parameters after an SGD
step must equal a single-process plain-autograd run over all ranks' data, for: delayed and regular
layers in one FSDP unit, two delayed layers sharing a weight, an embedding tied to a delayed output
layer, several micro-batches with gradient accumulation (``set_requires_gradient_sync(False)``) in a
zero-bubble order, and FSDP's resharding options. Each unit's reduce-scatter must start exactly once
per step, and only after its last contribution: a unit with delayed layers during the
``backward_dw()`` of its last delayed layer (so the reductions overlap the ``backward_dw()`` calls
still to come), one without during the backward. Torch's own ``fully_shard`` loses those gradients:
one case shows it, so the test would notice if that changed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
import splitgrad.distributed as sgd
from sg_helpers import to_reference
from spawn_helpers import check_case, run_cases, spawn_and_collect

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this PyTorch build",
)

D, VOCAB, BATCH, TOKENS = 8, 11, 4, 3
WORKER_TIMEOUT_S = 300


class Block(nn.Module):
    """One FSDP unit: a LayerNorm, two delayed layers (regular ones with ``delay=False``) and a
    regular one."""

    def __init__(self, name, delay=True):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = splitgrad.Linear(D, 2 * D, device="cpu", delay_wgrad_compute=delay, name=f"{name}.fc1")
        self.fc2 = splitgrad.Linear(2 * D, D, device="cpu", delay_wgrad_compute=delay, name=f"{name}.fc2")
        self.regular = splitgrad.Linear(D, D, device="cpu", name=f"{name}.regular")

    def forward(self, x):
        x = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        return x + torch.tanh(self.regular(x))


class TiedBlock(nn.Module):
    """Two delayed layers sharing one weight (and a bias each) in one FSDP unit."""

    def __init__(self):
        super().__init__()
        self.a = splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, name="tied.a")
        self.b = splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, name="tied.b")
        self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class LM(nn.Module):
    """An embedding tied to a delayed output layer (both in the root unit), blocks between."""

    def __init__(self, tied_block=False, delay=True):
        super().__init__()
        torch.manual_seed(0)  # the same initial parameters on every rank and for the reference
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block("blocks.0", delay), Block("blocks.1", delay)])
        if tied_block:
            self.blocks.append(TiedBlock())
        self.head = splitgrad.Linear(D, VOCAB, bias=False, device="cpu", delay_wgrad_compute=delay, name="head")
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(model, ids, targets):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def rank_data(step, world, micro=1):
    """[rank][micro] -> (ids, targets), rebuilt identically in any process."""
    data = []
    for rank in range(world):
        g = torch.Generator().manual_seed(1000 * step + rank)
        data.append([(torch.randint(VOCAB, (BATCH, TOKENS), generator=g),
                      torch.randint(VOCAB, (BATCH, TOKENS), generator=g)) for _ in range(micro)])
    return data


def reference_grads(reference, data):
    """Plain autograd over every rank's data: the mean loss over all of it (FSDP averages the
    ranks' mean losses; equal batch sizes make the two the same)."""
    micro = len(data[0])
    ids = [torch.cat([data[r][m][0] for r in range(len(data))]) for m in range(micro)]
    targets = [torch.cat([data[r][m][1] for r in range(len(data))]) for m in range(micro)]
    for i, t in zip(ids, targets):
        (lm_loss(reference, i, t) / micro).backward()


def shard(model, fully_shard=sgd.fully_shard, **kwargs):
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def delayed_layers(model):
    return [m for m in model.modules() if isinstance(m, splitgrad.Linear) and m.delay_wgrad_compute]


class LogTracker:
    """Which action each FSDP reduce-scatter of the step started in."""

    def __init__(self):
        sgd.fsdp_reduction_log.clear()
        self.during = []  # (unit's delayed layers, when, action)

    def do(self, label, fn):
        before = len(sgd.fsdp_reduction_log)
        fn()
        self.during += [(layers, when, label) for layers, when in sgd.fsdp_reduction_log[before:]]


def assert_sharded_grads_match(model, reference, what):
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{what}: {name} has no sharded gradient"
        got = p.grad.full_tensor()  # a collective: every rank, same order
        # on CUDA cuBLASLt and cuBLAS may sum in another order than the reference's GEMMs
        tolerance = dict(rtol=1e-5, atol=1e-6) if got.device.type == "cpu" else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, want[name].grad, **tolerance,
                                   msg=lambda m: f"{what}: {name}: {m}")


def assert_params_match(model, reference, what):
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor().detach(), want[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what}: {name}: {m}")


def step_both(model, reference, optimizer, ref_optimizer, data, step):
    """The end of a training step for the sharded model and its plain-autograd twin: sharded
    gradients equal the reference's over all ranks' data, then an SGD step each (the sharded one
    waits for the reductions: finish_fsdp_reductions) and equal parameters, then zero_grad."""
    reference_grads(reference, data)
    assert_sharded_grads_match(model, reference, f"step {step}")
    optimizer.step()
    ref_optimizer.step()
    assert_params_match(model, reference, f"after step {step}")
    optimizer.zero_grad()
    ref_optimizer.zero_grad()


EXPECTED_UNITS = {  # the units' delayed layers, as logged
    "blocks.0.fc1, blocks.0.fc2", "blocks.1.fc1, blocks.1.fc2", "head",
}


def case_one_step(rank, world, tied_block=False, reshard_after_forward=True, steps=2, device="cpu"):
    """backward, then backward_dw of every delayed layer, last first; twice, with SGD steps."""
    model = LM(tied_block).to(device)
    reference = to_reference(model)
    shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    units = EXPECTED_UNITS | ({"tied.a, tied.b"} if tied_block else set())
    for step in range(steps):
        data = [[(i.to(device), t.to(device)) for i, t in micro] for micro in rank_data(step, world)]
        ids, targets = data[rank][0]
        tracker = LogTracker()
        tracker.do("B", lm_loss(model, ids, targets).backward)
        for layer in reversed(delayed_layers(model)):
            tracker.do(f"W {layer.name}", layer.backward_dw)
        # every unit reduce-scattered once, right after the backward_dw of its last delayed layer
        # (head is the output layer: its W runs first, so its reduction overlaps all the others)
        assert sorted(u for u, _, _ in tracker.during) == sorted(units), tracker.during
        for unit, when, action in tracker.during:
            assert when == "backward_dw", tracker.during
            first_layer = unit.split(", ")[0]
            assert action == f"W {first_layer}", (unit, action)  # reversed order: the first is last
        assert [u for u, _, _ in tracker.during][0] == "head", tracker.during
        step_both(model, reference, optimizer, ref_optimizer, data, step)


def case_rank_dependent_w_order(rank, world):
    """Each rank runs its backward_dw() calls in an order of its own (even ranks last layer first,
    odd ranks first layer first): the held reduce-scatters still start in one order on every rank,
    so each unit's shards sum that same unit of every rank (units of different sizes, as the tied
    block's, would otherwise abort gloo; equal ones would be summed with another rank's unit)."""
    model = LM(tied_block=True)
    reference = to_reference(model)
    shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        data = rank_data(step, world)
        ids, targets = data[rank][0]
        tracker = LogTracker()
        lm_loss(model, ids, targets).backward()
        layers = delayed_layers(model)
        for layer in (layers if rank % 2 else list(reversed(layers))):
            tracker.do(f"W {layer.name}", layer.backward_dw)
        launched = [unit for unit, _, _ in tracker.during]
        everyone = [None] * world
        dist.all_gather_object(everyone, launched)
        assert all(order == launched for order in everyone), everyone
        assert sorted(launched) == sorted(EXPECTED_UNITS | {"tied.a, tied.b"}), launched
        step_both(model, reference, optimizer, ref_optimizer, data, step)


def case_micro_batches(rank, world):
    """Gradient accumulation in a zero-bubble order: F0 B0 (no sync) F1 B1 (sync) W0 W1. Nothing
    is reduced before the last W; then each unit once, with both micro-batches' gradients."""
    model = LM()
    reference = to_reference(model)
    shard(model)
    data = rank_data(0, world, micro=2)
    (ids0, t0), (ids1, t1) = data[rank]
    tracker = LogTracker()
    model.set_requires_gradient_sync(False)
    tracker.do("B0", (lm_loss(model, ids0, t0) / 2).backward)
    model.set_requires_gradient_sync(True)
    tracker.do("B1", (lm_loss(model, ids1, t1) / 2).backward)
    assert tracker.during == [], tracker.during
    for layer in reversed(delayed_layers(model)):
        tracker.do(f"W0 {layer.name}", layer.backward_dw)
    assert tracker.during == [], f"reduced before the last micro-batch's W: {tracker.during}"
    for layer in reversed(delayed_layers(model)):
        tracker.do(f"W1 {layer.name}", layer.backward_dw)
    assert sorted(u for u, _, _ in tracker.during) == sorted(EXPECTED_UNITS), tracker.during
    assert all(action.startswith("W1 ") for _, _, action in tracker.during), tracker.during
    sgd.finish_fsdp_reductions()
    reference_grads(reference, data)
    assert_sharded_grads_match(model, reference, "two micro-batches")


def case_regular_unit(rank, world):
    """A unit without delayed layers reduces in the backward, as FSDP does; the rest after W."""
    torch.manual_seed(0)
    model = nn.Sequential(splitgrad.Linear(D, D, device="cpu", name="regular"), nn.Tanh(),
                          splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, name="delayed"))
    reference = to_reference(model)
    sgd.fully_shard(model[0])
    sgd.fully_shard(model[2])
    sgd.fully_shard(model)
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(rank))
    tracker = LogTracker()
    tracker.do("B", lambda: model(x).square().mean().backward())
    tracker.do("W", model[2].backward_dw)
    assert tracker.during == [("-", "backward", "B"), ("delayed", "backward_dw", "W")], tracker.during
    sgd.finish_fsdp_reductions()
    xs = torch.cat([torch.randn(BATCH, D, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    reference(xs).square().mean().backward()
    assert_sharded_grads_match(model, reference, "regular and delayed units")


def case_mixed_precision(rank, world):
    """FSDP's bf16 mixed precision (bf16 compute, fp32 reduction): the delayed model's sharded
    gradients equal those of the same model with regular layers (wgrad inside the backward) under
    the same policy, to bf16 rounding of the sums' order, and both are near the fp32 reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    delayed, regular = LM(), LM(delay=False)
    reference = to_reference(delayed)
    shard(delayed, mp_policy=policy)
    shard(regular, mp_policy=policy)
    data = rank_data(0, world)
    ids, targets = data[rank][0]
    lm_loss(delayed, ids, targets).backward()
    splitgrad.backward_dw_all()
    sgd.finish_fsdp_reductions()
    lm_loss(regular, ids, targets).backward()
    reference_grads(reference, data)
    want = dict(reference.named_parameters())
    for (name, p), (_, q) in zip(delayed.named_parameters(), regular.named_parameters()):
        got, same_policy = p.grad.full_tensor(), q.grad.full_tensor()
        assert got.dtype == torch.float32, (name, got.dtype)
        scale = same_policy.abs().max().item()
        torch.testing.assert_close(got, same_policy, rtol=0, atol=2 ** -7 * scale,
                                   msg=lambda m: f"{name} vs regular layers under the same policy: {m}")
        torch.testing.assert_close(got, want[name].grad, rtol=0, atol=2 ** -5 * scale,
                                   msg=lambda m: f"{name} vs the fp32 reference: {m}")


def case_mixed_precision_micro_batches(rank, world):
    """bf16 mixed precision with gradient accumulation: two micro-batches, the first without
    gradient sync, each W right after its B (F B W F B W) or both after the last B (F B F B W W).
    A deferred gradient that lands after a no-sync backward is added to FSDP's fp32 accumulated
    gradient, as that backward's autograd gradients are: the delayed model's sharded gradients
    equal the regular model's under the same policy (no bf16 sum across micro-batches, no unit
    reduce-scattering a mix of fp32 and bf16 gradients)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    data = rank_data(0, world, micro=2)
    for order in ("FBW FBW", "FB FB WW"):
        delayed, regular = LM(), LM(delay=False)
        shard(delayed, mp_policy=policy)
        shard(regular, mp_policy=policy)
        for model in (delayed, regular):
            for m, (ids, targets) in enumerate(data[rank]):
                model.set_requires_gradient_sync(m == 1)
                (lm_loss(model, ids, targets) / 2).backward()
                if order == "FBW FBW":
                    splitgrad.backward_dw_all()
            splitgrad.backward_dw_all()
            sgd.finish_fsdp_reductions()
        for (name, p), (_, q) in zip(delayed.named_parameters(), regular.named_parameters()):
            got, want = p.grad.full_tensor(), q.grad.full_tensor()
            assert got.dtype == torch.float32, (order, name, got.dtype)
            scale = want.abs().max().item()
            # The embedding tied to the delayed head gets two contributions per pass: the regular
            # model sums them in its bf16 .grad, the delayed one in fp32 (the head's arrives after
            # the backward). Every other gradient is one bf16 value per pass, summed in fp32.
            atol = 2 ** -7 * scale if name == "embed.weight" else 1e-6 * scale
            torch.testing.assert_close(got, want, rtol=0, atol=atol,
                                       msg=lambda m: f"{order}: {name} vs regular layers under the same policy: {m}")


def case_torch_fully_shard_loses_deferred_grads(rank, world):
    """Why splitgrad's fully_shard exists: under torch's own, the deferred weight gradients land
    in the unsharded parameters after FSDP reduced, and the sharded gradients never get them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # a CPU mesh, as splitgrad's fully_shard picks for gloo (torch's default is the accelerator's)
    model = shard(LM(), fully_shard=torch_fully_shard, mesh=init_device_mesh("cpu", (world,)))
    ids, targets = rank_data(0, world)[rank][0]
    lm_loss(model, ids, targets).backward()
    splitgrad.backward_dw_all()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert "blocks.0.fc1.weight" in missing and "head.weight" not in missing, missing
    # (head.weight is tied to the embedding, whose immediate gradient FSDP did reduce: a partial sum)


def case_dropped_item(rank, world):
    """A stashed input modified in place: that layer's backward_dw() raises and its item is dropped,
    so its unit can never reduce a complete gradient. finish_fsdp_reductions() says so, naming the
    unit, after the other units reduced; nothing partial leaks into the next step, which is exact."""
    model = LM()
    reference = to_reference(model)
    shard(model)
    data = rank_data(0, world)
    ids, targets = data[rank][0]
    stashed = {}
    hook = model.blocks[1].fc2.register_forward_pre_hook(lambda m, args: stashed.setdefault("x", args[0]))
    lm_loss(model, ids, targets).backward()
    hook.remove()
    with torch.no_grad():
        stashed["x"].add_(1.0)  # the input blocks.1.fc2 stashed for its wgrad
    for layer in reversed(delayed_layers(model)):
        try:
            layer.backward_dw()
        except RuntimeError as error:
            assert layer.name == "blocks.1.fc2" and "modified in place" in str(error), (layer.name, str(error))
    try:
        sgd.finish_fsdp_reductions()
    except RuntimeError as error:
        assert "'blocks.1.fc1, blocks.1.fc2'" in str(error) and "dropped" in str(error), str(error)
    else:
        raise AssertionError("finish_fsdp_reductions() said nothing about a unit that cannot reduce")
    assert model.blocks[0].fc1.weight.grad is not None, "the other units were reduced"
    model.zero_grad()
    data = rank_data(1, world)
    ids, targets = data[rank][0]
    lm_loss(model, ids, targets).backward()
    splitgrad.backward_dw_all()
    sgd.finish_fsdp_reductions()
    reference_grads(reference, data)
    assert_sharded_grads_match(model, reference, "the step after the dropped item")


def case_pending_work_checks(rank, world):
    """set_pending_work_policy("error") under fully_shard: with one layer's backward_dw() forgotten,
    optimizer.step(), optimizer.zero_grad(), module.zero_grad() and state_dict() raise naming it
    (they hold the sharded parameters; the work is queued on the unsharded ones), and change
    nothing; once it runs, both steps equal plain autograd (nothing held back leaks into step 2)."""
    model = LM()
    reference = to_reference(model)
    shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    forgotten = model.blocks[0].fc1
    splitgrad.set_pending_work_policy("error")
    try:
        for step in range(2):
            data = rank_data(step, world)
            ids, targets = data[rank][0]
            lm_loss(model, ids, targets).backward()
            for layer in reversed(delayed_layers(model)):
                if layer is not forgotten:
                    layer.backward_dw()
            for what, call in (("SGD.step()", optimizer.step), ("SGD.zero_grad()", optimizer.zero_grad),
                               ("zero_grad()", model.zero_grad), ("state_dict()", model.state_dict)):
                try:
                    call()
                except splitgrad.PendingWgradError as error:
                    assert what in str(error) and "'blocks.0.fc1'" in str(error), (what, str(error))
                else:
                    raise AssertionError(f"{what} under fully_shard did not raise for pending work")
            forgotten.backward_dw()
            step_both(model, reference, optimizer, ref_optimizer, data, step)
    finally:
        splitgrad.set_pending_work_policy("warn")


def case_refuses_main_grad(rank, world):
    layer = splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                             name="fused")
    try:
        sgd.fully_shard(layer)
    except ValueError as error:
        assert "fuse_wgrad_accumulation" in str(error) and "fused" in str(error), str(error)
    else:
        raise AssertionError("fully_shard accepted a fuse_wgrad_accumulation layer")


ROUTING = [[2, 0, 2], [0, 4, 0], [1, 1, 2], [4, 0, 0]]  # per rank: experts without rows on some


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.regular = splitgrad.Linear(D, D, device="cpu", name="regular")
        self.experts = splitgrad.GroupedLinear(3, D, D, device="cpu", delay_wgrad_compute=True,
                                               name="experts")

    def forward(self, x, m_splits):
        return self.experts(torch.tanh(self.regular(x)), m_splits)


def case_grouped_experts(rank, world):
    """A unit of delayed GroupedLinear experts (each rank routed its own way) reduce-scatters once,
    after the experts' backward_dw; a regular unit in the backward. Sharded gradients equal plain
    autograd over all ranks' data."""
    torch.manual_seed(0)
    model = MoE()
    experts = model.experts
    reference = to_reference(model)

    def loss(m, x, splits):
        return m(x, splits).square().mean()

    sgd.fully_shard(experts)
    sgd.fully_shard(model)
    xs = [torch.randn(BATCH, D, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    tracker = LogTracker()
    tracker.do("B", loss(model, xs[rank], ROUTING[rank]).backward)
    tracker.do("W", experts.backward_dw)
    assert tracker.during == [("-", "backward", "B"), ("experts", "backward_dw", "W")], tracker.during
    sgd.finish_fsdp_reductions()
    (sum(loss(reference, xs[r], ROUTING[r]) for r in range(world)) / world).backward()
    assert_sharded_grads_match(model, reference, "grouped experts")


class LayerNormBlock(nn.Module):
    """A TE-style unit: a delayed LayerNormLinear (RMSNorm) and a delayed LayerNormMLP (swiglu)."""

    def __init__(self, name):
        super().__init__()
        self.qkv = splitgrad.LayerNormLinear(D, D, normalization="RMSNorm", device="cpu", delay_wgrad_compute=True,
                                             name=f"{name}.qkv")
        self.mlp = splitgrad.LayerNormMLP(D, 2 * D, activation="swiglu", device="cpu", delay_wgrad_compute=True,
                                          name=f"{name}.mlp")

    def forward(self, x):
        x = x + torch.tanh(self.qkv(x))
        return x + self.mlp(x)


def case_layernorm_modules(rank, world):
    """Units of LayerNormLinear and LayerNormMLP, two steps with SGD: each unit reduce-scatters once,
    after the backward_dw of its last delayed module (the norms' gradients, computed in the backward,
    wait for it); sharded gradients and parameters equal plain autograd over all ranks' data."""
    torch.manual_seed(0)
    model = nn.Sequential(LayerNormBlock("blocks.0"), LayerNormBlock("blocks.1"))
    reference = to_reference(model)
    for block in model:
        sgd.fully_shard(block)
    sgd.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    layers = [m for m in model.modules() if isinstance(m, (splitgrad.LayerNormLinear, splitgrad.LayerNormMLP))]
    for step in range(2):
        xs = [torch.randn(BATCH, TOKENS, D, generator=torch.Generator().manual_seed(100 * step + r))
              for r in range(world)]
        tracker = LogTracker()
        tracker.do("B", lambda: model(xs[rank]).square().mean().backward())
        for layer in reversed(layers):
            tracker.do(f"W {layer.name}", layer.backward_dw)
        assert tracker.during == [("blocks.1.qkv, blocks.1.mlp", "backward_dw", "W blocks.1.qkv"),
                                  ("blocks.0.qkv, blocks.0.mlp", "backward_dw", "W blocks.0.qkv")], tracker.during
        (sum(reference(x).square().mean() for x in xs) / world).backward()
        assert_sharded_grads_match(model, reference, f"step {step}")
        optimizer.step()
        ref_optimizer.step()
        assert_params_match(model, reference, f"after step {step}")
        optimizer.zero_grad()
        ref_optimizer.zero_grad()


CASES = {
    "one_step": case_one_step,
    "tied_block": functools.partial(case_one_step, tied_block=True),
    "no_reshard_after_forward": functools.partial(case_one_step, reshard_after_forward=False, steps=1),
    "micro_batches": case_micro_batches,
    "rank_dependent_w_order": case_rank_dependent_w_order,
    "mixed_precision": case_mixed_precision,
    "mixed_precision_micro_batches": case_mixed_precision_micro_batches,
    "regular_unit": case_regular_unit,
    "torch_fully_shard_loses_deferred_grads": case_torch_fully_shard_loses_deferred_grads,
    "dropped_item": case_dropped_item,
    "refuses_main_grad": case_refuses_main_grad,
    "pending_work_checks": case_pending_work_checks,
    "grouped_experts": case_grouped_experts,
    "layernorm_modules": case_layernorm_modules,
}


def _worker(rank, world, init_file, out_dir):
    run_cases(CASES, rank, world, init_file, out_dir)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    world = request.param
    return spawn_and_collect(_worker, world, tmp_path_factory.mktemp(f"fsdp{world}"), CASES, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("case", ["one_step", "tied_block", "no_reshard_after_forward"])
def test_sharded_gradients_and_parameters_match_plain_autograd(results, case):
    """Sharded gradients and parameters after SGD steps equal plain autograd over all ranks' data,
    tied weights included; every unit reduce-scatters once per step, right after the W of its
    last delayed layer, the output layer's first (overlapping the W steps still to come)."""
    check_case(results, case)


def test_rank_dependent_backward_dw_order_reduces_matching_units(results):
    check_case(results, "rank_dependent_w_order")


def test_gradient_accumulation_over_micro_batches_reduces_once(results):
    check_case(results, "micro_batches")


def test_bf16_mixed_precision_policy(results):
    check_case(results, "mixed_precision")


def test_bf16_mixed_precision_with_gradient_accumulation(results):
    check_case(results, "mixed_precision_micro_batches")


def test_unit_without_delayed_layers_reduces_in_backward(results):
    check_case(results, "regular_unit")


def test_torch_fully_shard_alone_loses_deferred_gradients(results):
    check_case(results, "torch_fully_shard_loses_deferred_grads")


def test_dropped_deferred_item_is_reported_and_nothing_partial_is_reduced(results):
    check_case(results, "dropped_item")


def test_pending_work_checks_see_the_unsharded_parameters(results):
    check_case(results, "pending_work_checks")


def test_grouped_linear_experts(results):
    check_case(results, "grouped_experts")


def test_layernorm_linear_and_mlp_units(results):
    check_case(results, "layernorm_modules")


def test_fuse_wgrad_accumulation_is_refused(results):
    check_case(results, "refuses_main_grad")


def test_gloo_group_gets_a_cpu_mesh_by_default(tmp_path, monkeypatch):
    """Without a mesh, a gloo-only group shards on a CPU mesh over all ranks (torch's default is
    the accelerator's, which on a GPU machine with fewer GPUs than gloo ranks fails); a mesh the
    caller passes is kept."""
    import splitgrad._fsdp as fsdp_module
    from torch.distributed.device_mesh import init_device_mesh

    seen = []
    torch_fully_shard = fsdp_module._torch_fully_shard

    def recording_fully_shard(module, **kwargs):
        seen.append(kwargs.get("mesh"))
        return torch_fully_shard(module, **kwargs)

    monkeypatch.setattr(fsdp_module, "_torch_fully_shard", recording_fully_shard)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sgd.fully_shard(splitgrad.Linear(2, 2, device="cpu", delay_wgrad_compute=True))
        assert seen[-1] is not None and seen[-1].device_type == "cpu" and seen[-1].size() == 1, seen
        mine = init_device_mesh("cpu", (1,))
        sgd.fully_shard(splitgrad.Linear(2, 2, device="cpu", delay_wgrad_compute=True), mesh=mine)
        assert seen[-1] is mine
    finally:
        dist.destroy_process_group()


CUDA_CASES = {
    "one_step[cuda]": functools.partial(case_one_step, device="cuda"),
    "tied_block[cuda]": functools.partial(case_one_step, tied_block=True, device="cuda"),
}


def _cuda_worker(rank, world, init_file, out_dir):
    run_cases(CUDA_CASES, rank, world, init_file, out_dir, backend="nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, FSDP's CUDA streams)")
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_on_cuda_with_fsdps_streams(tmp_path, case):
    """One process per GPU (as many as there are, up to 2) over NCCL: the deferred reduce-scatters
    run on FSDP's reduce-scatter stream while backward_dw() goes on, and the optimizer step waits
    for them."""
    world = min(2, torch.cuda.device_count())
    results = spawn_and_collect(_cuda_worker, world, tmp_path, {case: None}, WORKER_TIMEOUT_S)
    check_case(results, case)
