"""Grad-ready hooks (SPEC §2): ``fn(param)`` once per backward pass, after the LAST contribution to
``param`` (immediate or deferred, from any layer) has landed, when ``param``'s gradient already
equals plain autograd's."""

import gc
import weakref

import pytest
import torch
from torch import nn

import splitgrad
from sg_helpers import (
    assert_grads_match,
    backward_dw_each,
    gradient_of,
    make_data,
    run_schedule,
    to_reference,
)

D = 8


def linear(delay=True, **kw):
    return splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=delay, **kw)


class Recorder:
    """Records backward/W events and hook calls in order; each hook call snapshots the gradient."""

    def __init__(self):
        self.events = []

    def hook(self, label):
        def fn(param):
            self.events.append(("hook", label, gradient_of(param).clone()))
        return fn

    def mark(self, *event):
        self.events.append(event)

    def labels(self):
        return [e[:2] if e[0] == "hook" else e for e in self.events]

    def hook_grads(self, label):
        return [e[2] for e in self.events if e[0] == "hook" and e[1] == label]


@pytest.mark.parametrize("w_order", [(0, 1), (1, 0)], ids=["W a,b", "W b,a"])
def test_hook_fires_after_last_tied_contribution(w_order):
    """A weight tied between two delayed layers and a regular one: the hook fires once, right after
    the second layer's backward_dw(), with the full gradient in place."""
    model = nn.Sequential(linear(True, name="a"), nn.Tanh(), linear(True, name="b"), nn.Tanh(),
                          linear(False, name="c"))
    model[2].weight = model[0].weight
    model[4].weight = model[0].weight
    shared = model[0].weight
    reference = to_reference(model)
    rec = Recorder()
    handle = splitgrad.register_grad_ready_hook(shared, rec.hook("shared"))
    (x,), (gy,) = make_data(1, (4, D), D)

    model(x).backward(gy)
    rec.mark("B")
    reference(x).backward(gy)
    for i in w_order:
        layer = model[2 * i]
        rec.mark("W", layer.name)
        layer.backward_dw()

    last = model[2 * w_order[-1]].name
    first = model[2 * w_order[0]].name
    assert rec.labels() == [("B",), ("W", first), ("W", last), ("hook", "shared")]
    # at the moment the hook ran, the gradient was complete
    torch.testing.assert_close(rec.hook_grads("shared")[0], reference[0].weight.grad)
    assert_grads_match(model, reference, exact=False)  # three terms on the shared weight
    handle.remove()


def test_hook_once_per_backward_pass():
    """Two micro-batches (F0 F1 B0 B1 W0 W1): the hook fires once per pass, after that pass's W,
    each time with the gradient accumulated so far equal to the reference's after that pass."""
    model = nn.Sequential(linear(True), nn.Tanh(), linear(True))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    rec = Recorder()
    splitgrad.register_grad_ready_hook(model[0].weight, rec.hook("w"))
    splitgrad.register_grad_ready_hook(model[2].bias, rec.hook("b2"))
    xs, gys = make_data(2, (4, D), D)

    run_schedule("F0 F1 B0 B1", model, xs, gys)
    rec.mark("B")
    assert rec.labels() == [("B",)]
    expected = []
    for i in range(2):
        reference(xs[i]).backward(gys[i])
        expected.append(reference[0].weight.grad.clone())
    for i in range(2):
        rec.mark("W", i)
        backward_dw_each(model)
    assert rec.labels() == [("B",), ("W", 0), ("hook", "w"), ("hook", "b2"),
                            ("W", 1), ("hook", "w"), ("hook", "b2")]
    for got, want in zip(rec.hook_grads("w"), expected):
        torch.testing.assert_close(got, want)
    assert_grads_match(model, reference, exact=False)


def test_hook_on_embedding_tied_to_delayed_output_layer():
    """Mixed users: the embedding's contribution lands in backward, the tied delayed output layer's
    in backward_dw(); the hook waits for the latter."""
    vocab = 11
    embed = nn.Embedding(vocab, D)
    head = splitgrad.Linear(D, vocab, bias=False, device="cpu", delay_wgrad_compute=True)
    head.weight = embed.weight
    model = nn.Sequential(embed, linear(True), nn.Tanh(), head)
    reference = to_reference(model)
    rec = Recorder()
    splitgrad.register_grad_ready_hook(embed.weight, rec.hook("table"))
    tokens = torch.randint(0, vocab, (3, 4))
    gy = torch.randn(3, 4, vocab)
    model(tokens).backward(gy)
    rec.mark("B")
    reference(tokens).backward(gy)
    rec.mark("W", "hidden")
    model[1].backward_dw()
    rec.mark("W", "head")
    head.backward_dw()
    assert rec.labels() == [("B",), ("W", "hidden"), ("W", "head"), ("hook", "table")]
    torch.testing.assert_close(rec.hook_grads("table")[0], reference[0].weight.grad, rtol=0, atol=0)
    assert_grads_match(model, reference, exact=True)


def test_hook_on_param_used_only_by_autograd_ops():
    """A plain nn.Linear's weight: the hook fires once at the end of each backward pass."""
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    rec = Recorder()
    splitgrad.register_grad_ready_hook(model[0].weight, rec.hook("w"))
    xs, gys = make_data(2, (4, D), D)
    for i in range(2):
        model(xs[i]).backward(gys[i])
        rec.mark("B", i)
        reference(xs[i]).backward(gys[i])
        torch.testing.assert_close(rec.hook_grads("w")[-1], reference[0].weight.grad, rtol=0, atol=0)
    assert rec.labels() == [("hook", "w"), ("B", 0), ("hook", "w"), ("B", 1)]


def test_hook_on_regular_layer():
    """A regular (non-delayed) splitgrad layer: the hook fires during backward(), once, after
    both contributions to the tied weight."""
    model = nn.Sequential(linear(False), nn.Tanh(), linear(False))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    rec = Recorder()
    splitgrad.register_grad_ready_hook(model[0].weight, rec.hook("w"))
    (x,), (gy,) = make_data(1, (4, D), D)
    model(x).backward(gy)
    rec.mark("B")
    reference(x).backward(gy)
    assert rec.labels() == [("hook", "w"), ("B",)]
    torch.testing.assert_close(rec.hook_grads("w")[0], reference[0].weight.grad, rtol=0, atol=0)
    model[0].backward_dw()  # a no-op on a regular layer: no second firing
    assert rec.labels() == [("hook", "w"), ("B",)]


def test_hook_with_fused_main_grad():
    """With fuse_wgrad_accumulation the hook sees the complete main_grad and the flag set."""
    model = nn.Sequential(linear(True, fuse_wgrad_accumulation=True), nn.Tanh(),
                          linear(True, fuse_wgrad_accumulation=True))
    model[2].weight = model[0].weight
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape)
        p.grad_added_to_main_grad = False
    reference = to_reference(model)
    flags = []
    rec = Recorder()
    splitgrad.register_grad_ready_hook(model[0].weight, rec.hook("w"))
    splitgrad.register_grad_ready_hook(model[0].weight, lambda p: flags.append(p.grad_added_to_main_grad))
    (x,), (gy,) = make_data(1, (4, D), D)
    model(x).backward(gy)
    reference(x).backward(gy)
    model[0].backward_dw()
    assert rec.labels() == []
    model[2].backward_dw()
    assert rec.labels() == [("hook", "w")] and flags == [True]
    torch.testing.assert_close(rec.hook_grads("w")[0], reference[0].weight.grad)


def test_hook_removal():
    model = nn.Sequential(linear(True))
    calls = []
    handle = splitgrad.register_grad_ready_hook(model[0].weight, calls.append)
    keep = splitgrad.register_grad_ready_hook(model[0].weight, lambda p: calls.append("kept"))
    (x,), (gy,) = make_data(1, (4, D), D)
    model(x).backward(gy)
    model[0].backward_dw()
    assert len(calls) == 2 and calls[0] is model[0].weight
    handle.remove()
    assert not handle.active
    handle.remove()  # idempotent
    model(x).backward(gy)
    model[0].backward_dw()
    assert calls[2:] == ["kept"]
    keep.remove()
    model(x).backward(gy)
    model[0].backward_dw()
    assert len(calls) == 3


def test_register_grad_ready_hook_rejects_non_parameters():
    with pytest.raises(TypeError):
        splitgrad.register_grad_ready_hook("not a tensor", lambda p: None)
    with pytest.raises(TypeError):
        splitgrad.register_grad_ready_hook(nn.Parameter(torch.zeros(2)), "not callable")
    with pytest.raises(ValueError, match="leaf"):
        splitgrad.register_grad_ready_hook(torch.zeros(2), lambda p: None)


# ------------------------------------------------------------------------------------------------
# Linear.register_wgrad_accumulation_and_reduce_hooks (TE's name)
# ------------------------------------------------------------------------------------------------


def test_reduce_hooks_one_argument():
    """hook(param) for the weight and the bias, once each per pass, after backward_dw()."""
    layer = linear(True)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda p: calls.append(p))
    (x,), (gy,) = make_data(1, (4, D), D)
    layer(x).backward(gy)
    assert calls == []
    layer.backward_dw()
    assert sorted(map(id, calls)) == sorted([id(layer.weight), id(layer.bias)])


@pytest.mark.parametrize("signature", ["no-argument", "star-args"])
def test_reduce_hooks_zero_argument_te_style(signature):
    """TE's hooks take no argument (Megatron's: ``*unused``): hook() is called as TE calls it, once
    per backward pass of the layer, when every gradient of the layer for that pass is complete."""
    layer = linear(True)
    reference = to_reference(layer)
    calls = []

    def te_hook(*unused):
        assert unused == ()
        calls.append({name: p.grad.clone() for name, p in layer.named_parameters()})

    layer.register_wgrad_accumulation_and_reduce_hooks(te_hook if signature == "star-args" else lambda: te_hook())
    xs, gys = make_data(2, (4, D), D)
    for step, (x, gy) in enumerate(zip(xs, gys)):
        layer(x).backward(gy)
        assert len(calls) == step, "not before the deferred gradients have landed"
        layer.backward_dw()
        reference(x).backward(gy)
        assert len(calls) == step + 1, "once per pass, not once per parameter"
        for name, p in reference.named_parameters():
            torch.testing.assert_close(calls[-1][name], p.grad, rtol=0, atol=0)
    assert len(calls) == 2


def test_te_style_hook_once_per_pass_of_a_module_with_tied_parameters_in_any_order():
    """A no-argument hook of a module whose weight is tied to a later layer fires once per pass,
    after that pass's last contribution to any of its parameters (micro-batches interleaved)."""
    model = nn.Sequential(linear(True, name="a"), nn.Tanh(), linear(True, name="b"))
    model[2].weight = model[0].weight
    reference = to_reference(model)
    seen = []
    model[0].register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append((model[0].weight.grad.clone(), model[0].bias.grad.clone())))
    xs, gys = make_data(2, (4, D), D)
    run_schedule("F0 F1 B0 B1", model, xs, gys)
    model[0].backward_dw()  # pass 0 of a: the tied weight still owes b's pass-0 work
    model[0].backward_dw()
    assert seen == []
    model[2].backward_dw()  # pass 0 complete
    assert len(seen) == 1
    model[2].backward_dw()  # pass 1 complete
    assert len(seen) == 2
    run_schedule("F0 F1 B0 B1", reference, xs, gys)
    torch.testing.assert_close(seen[-1][0], reference[0].weight.grad)
    torch.testing.assert_close(seen[-1][1], reference[0].bias.grad, rtol=0, atol=0)


def test_te_style_hook_counts_only_passes_that_ran_the_module():
    """A regular layer M whose weight is tied to a delayed layer N: a pass that runs only N makes
    M's weight ready but is no pass of M; M's no-argument hook fires once, for the pass that ran
    both, after N's deferred contribution of that pass has landed."""
    m, n = linear(False, name="m"), linear(True, name="n")
    n.weight = m.weight
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(splitgrad.pending_wgrads()))
    x = torch.randn(4, D)
    n(x).sum().backward()  # a pass of n only
    n.backward_dw()
    assert calls == []
    n(m(x)).sum().backward()  # a pass of both: m's bias is ready now, the tied weight is not
    assert calls == []
    n.backward_dw()
    assert calls == [0], "once, when nothing is owed any more"


def _fully_tied_pair(kind, delay_m, delay_n):
    """Two modules of one kind, the second holding every parameter of the first."""
    def make(delay):
        if kind == "Linear":
            return splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=delay)
        if kind == "GroupedLinear":
            return splitgrad.GroupedLinear(2, D, D, device="cpu", delay_wgrad_compute=delay)
        return splitgrad.LayerNormLinear(D, D, device="cpu", delay_wgrad_compute=delay)

    m, n = make(delay_m), make(delay_n)
    for name, p in m.named_parameters():
        setattr(n, name, p)
    return m, n


def _apply(module, x):
    return module(x, [1, 3]) if hasattr(module, "num_gemms") else module(x)  # GroupedLinear, its twin


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear", "LayerNormLinear"])
@pytest.mark.parametrize("delay_m", [True, False], ids=["m delayed", "m regular"])
@pytest.mark.parametrize("delay_n", [True, False], ids=["n delayed", "n regular"])
def test_te_style_hook_skips_a_pass_that_reaches_all_its_parameters_through_another_layer(
        kind, delay_m, delay_n):
    """Module n holds every parameter of module m: a pass that runs only n makes all of m's
    gradients ready, but it is no pass of m, whose ops never ran; m's no-argument hook fires for
    the passes that ran m, once each, with plain autograd's gradients; n's hook for every pass."""
    m, n = _fully_tied_pair(kind, delay_m, delay_n)
    reference_m, reference_n = to_reference(nn.ModuleList([m, n]))  # the ties kept
    calls_m, calls_n = [], []
    m.register_wgrad_accumulation_and_reduce_hooks(
        lambda: calls_m.append({k: p.grad.clone() for k, p in m.named_parameters()}))
    n.register_wgrad_accumulation_and_reduce_hooks(lambda: calls_n.append(1))
    xs, gys = make_data(3, (4, D), D)

    def finish(module):
        if module.delay_wgrad_compute:
            module.backward_dw()

    _apply(n, xs[0]).backward(gys[0])  # a pass of n only
    finish(n)
    assert (calls_m, calls_n) == ([], [1])
    _apply(m, xs[1]).backward(gys[1])  # a pass of m only
    finish(m)
    assert (len(calls_m), calls_n) == (1, [1])
    _apply(n, _apply(m, xs[2])).backward(gys[2])  # a pass of both
    finish(n)
    finish(m)
    assert (len(calls_m), len(calls_n)) == (2, 2)
    _apply(reference_n, xs[0]).backward(gys[0])
    _apply(reference_m, xs[1]).backward(gys[1])
    _apply(reference_n, _apply(reference_m, xs[2])).backward(gys[2])
    for name, p in reference_m.named_parameters():
        torch.testing.assert_close(calls_m[-1][name], p.grad)


@pytest.mark.parametrize("tie", ["all", "weight"])
@pytest.mark.parametrize("delay_n", [True, False], ids=["n delayed", "n regular"])
def test_te_style_hook_of_a_compiled_module_fires_once_per_pass(tie, delay_n):
    """Inside a compiled graph the module's ops do not run as such: its passes cannot name it, and
    count as its own, also when an eager layer tied to it runs in the same pass."""
    m, n = linear(False, name="m"), linear(delay_n, name="n")
    n.weight = m.weight
    if tie == "all":
        n.bias = m.bias
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(m.weight.grad.clone()))
    reference_m, reference_n = to_reference(nn.ModuleList([m, n]))
    compiled = torch.compile(m, backend="aot_eager")
    xs, gys = make_data(2, (4, D), D)
    compiled(xs[0]).backward(gys[0])  # m alone
    assert len(calls) == 1
    assert m._layer.ran_untracked and not n._layer.ran_untracked
    n(compiled(xs[1])).backward(gys[1])  # both
    if delay_n:
        assert len(calls) == 1, "not before n's deferred part of the tied weight"
        n.backward_dw()
    assert len(calls) == 2
    reference_m(xs[0]).backward(gys[0])
    reference_n(reference_m(xs[1])).backward(gys[1])
    torch.testing.assert_close(calls[-1], reference_m.weight.grad)


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_te_style_hook_of_a_module_training_only_its_norm(delay):
    """A LayerNormLinear whose GEMM parameters are frozen: its trainable parameters are the norm's,
    whose gradients come from an ordinary op. Its passes are those that ran its GEMM's backward
    (for the norm's input gradient); a pass of another layer sharing its norm is not."""
    m = splitgrad.LayerNormLinear(D, D, device="cpu", delay_wgrad_compute=delay)
    n = splitgrad.LayerNormLinear(D, D, device="cpu", delay_wgrad_compute=delay)
    m.weight.requires_grad_(False)
    m.bias.requires_grad_(False)
    n.layer_norm_weight, n.layer_norm_bias = m.layer_norm_weight, m.layer_norm_bias
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    x = torch.randn(4, D)
    n(x).sum().backward()
    if delay:
        n.backward_dw()
    assert calls == []
    m(x).sum().backward()  # nothing deferred: the GEMM's parameters are frozen
    assert calls == [1]


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_te_style_hook_goes_with_its_deleted_module(delay):
    """A module deleted while another layer keeps its parameters: its hooks are removed with it
    (the layer holding the parameters now runs no pass of it), and what they hold is freed."""
    m, n = linear(delay, name="m"), linear(delay, name="n")
    n.weight, n.bias = m.weight, m.bias
    held = nn.Linear(1, 1)
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(held))
    m.register_wgrad_accumulation_and_reduce_hooks(lambda p: calls.append(held))
    alive = weakref.ref(held)
    del m, held
    gc.collect()
    x = torch.randn(4, D)
    n(x).sum().backward()
    if delay:
        n.backward_dw()
    assert calls == [] and alive() is None


def test_te_style_hook_fires_after_the_module_was_exported():
    """torch.export traces the forward with fake parameters; the hooks stay on the real ones."""
    layer = linear(False)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    x = torch.randn(4, D)
    torch.export.export(layer, (x,))
    layer(x).sum().backward()
    assert calls == [1]


def test_te_style_hook_of_a_delayed_layernorm_module_with_many_passes_outstanding():
    """The norm's gradients are ready at each backward, the GEMM's at each backward_dw(): with a
    hundred passes outstanding, every one still calls the hook once."""
    layer = splitgrad.LayerNormLinear(D, D, device="cpu", delay_wgrad_compute=True)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    x = torch.randn(4, D)
    for _ in range(100):
        layer(x).sum().backward()
    assert calls == []
    for _ in range(100):
        layer.backward_dw()
    assert len(calls) == 100


def test_te_style_hook_keeps_a_pass_under_way_across_re_tying():
    layer = splitgrad.LayerNormLinear(D, D, device="cpu", delay_wgrad_compute=True)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(layer.weight.grad.clone()))
    x = torch.randn(4, D)
    layer(x).sum().backward()  # the norm's gradients are ready now, the GEMM's not
    layer.weight = layer.weight  # re-installs the hooks mid-pass
    layer.backward_dw()
    assert len(calls) == 1
    layer(x).sum().backward()
    layer.backward_dw()
    assert len(calls) == 2


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_reduce_hooks_follow_freezing_and_unfreezing(delay):
    layer = linear(delay)
    no_argument, per_param = [], []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: no_argument.append(1))
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda p: per_param.append(id(p)))
    x = torch.randn(4, D)

    def step():
        layer(x).sum().backward()
        if delay:
            layer.backward_dw()

    step()
    layer.bias.requires_grad_(False)  # frozen after registration: the hooks stop waiting for it
    step()
    step()
    assert len(no_argument) == 3
    assert per_param.count(id(layer.bias)) == 1 and per_param.count(id(layer.weight)) == 3
    layer.bias.requires_grad_(True)  # unfrozen: its hook is back from the next forward
    step()
    assert len(no_argument) == 4 and per_param.count(id(layer.bias)) == 2


def test_grad_ready_pass_tells_the_pass_a_hook_reports():
    layer = linear(True)
    seen = []
    splitgrad.register_grad_ready_hook(layer.weight, lambda p: seen.append(splitgrad.grad_ready_pass()))
    assert splitgrad.grad_ready_pass() is None
    x = torch.randn(4, D)
    layer(x).sum().backward()
    layer(x).sum().backward()
    passes = layer._layer.pending_passes()
    layer.backward_dw()
    layer.backward_dw()
    assert seen == passes and len(set(passes)) == 2


def test_reduce_hook_registered_on_modules_sharing_a_parameter_runs_once_for_it():
    """A reducer registered on every module (as a data-parallel wrapper does) must reduce a tied
    weight once per pass, not once per module holding it."""
    model = nn.Sequential(linear(True, name="a"), nn.Tanh(), linear(True, name="b"))
    model[2].weight = model[0].weight
    calls = []

    def reduce(param):
        calls.append(id(param))

    for layer in (model[0], model[2]):
        layer.register_wgrad_accumulation_and_reduce_hooks(reduce)
    (x,), (gy,) = make_data(1, (4, D), D)
    model(x).backward(gy)
    splitgrad.backward_dw_all()
    expected = [id(model[0].weight), id(model[0].bias), id(model[2].bias)]
    assert sorted(calls) == sorted(expected)
    # removing the share of one module keeps the other's: untie b, a's hooks still fire for a
    model[2].weight = nn.Parameter(model[0].weight.detach().clone())
    calls.clear()
    model(x).backward(gy)
    splitgrad.backward_dw_all()
    assert sorted(calls) == sorted(expected[:2] + [id(model[2].weight), id(model[2].bias)])


def test_delayed_modules_mark_their_gemm_parameters_skip_backward_post_hook():
    """TE's mark, which Megatron's DDP reads to reduce from the module's hooks instead of
    AccumulateGrad's: on the GEMM parameters of delayed modules (also ones tied in later), not on
    regular modules' or the norms'."""
    delayed, regular = linear(True), linear(False)
    assert delayed.weight.skip_backward_post_hook is True and delayed.bias.skip_backward_post_hook is True
    assert not hasattr(regular.weight, "skip_backward_post_hook")
    regular_weight = nn.Parameter(torch.randn(D, D))
    delayed.weight = regular_weight
    assert regular_weight.skip_backward_post_hook is True
    mlp = splitgrad.LayerNormMLP(D, 2 * D, device="cpu", delay_wgrad_compute=True)
    assert [n for n, p in mlp.named_parameters() if getattr(p, "skip_backward_post_hook", False)] == [
        "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    experts = splitgrad.GroupedLinear(3, D, D, device="cpu", delay_wgrad_compute=True)
    assert all(p.skip_backward_post_hook for p in experts.parameters())


class MegatronDDPHooks:
    """Megatron-core DDP's gradient-hook wiring with delay_wgrad_compute (one rank): a parameter TE
    marks ``skip_backward_post_hook`` gets ``hook(*unused)`` through
    ``register_wgrad_accumulation_and_reduce_hooks`` of each module holding it, the others an
    AccumulateGrad hook. The hook folds ``.grad`` into ``main_grad`` unless it is already there,
    clears ``.grad`` and registers the parameter ready with its bucket, which starts the bucket's
    all-reduce when all its parameters are (here: records what the all-reduce would send)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ready: set[int] = set()
        self.sent: dict[int, torch.Tensor] = {}
        self.accumulators = []
        for p in self.params:
            if getattr(p, "skip_backward_post_hook", False):
                for module in model.modules():
                    if hasattr(module, "register_wgrad_accumulation_and_reduce_hooks"):
                        if any(q is p for q in module.parameters()):
                            module.register_wgrad_accumulation_and_reduce_hooks(self._make_hook(p))
            else:
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(self._make_hook(p))
                self.accumulators.append(accumulator)

    def _make_hook(self, param):
        def hook(*unused):
            if param.grad is not None and not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
            assert id(param) not in self.ready, "Cannot set grad twice"
            self.ready.add(id(param))
            if len(self.ready) == len(self.params):  # the bucket's all-reduce starts
                self.sent = {id(q): q.main_grad.clone() for q in self.params}
        return hook

    def finish_grad_sync(self) -> dict[int, torch.Tensor]:
        assert len(self.ready) == len(self.params), "a parameter was never registered ready"
        sent, self.ready, self.sent = self.sent, set(), {}
        return sent


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "grad"])
def test_megatron_ddp_hook_wiring_reduces_complete_gradients(fused):
    model = nn.Sequential(
        splitgrad.LayerNormMLP(D, 2 * D, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        splitgrad.Linear(D, D, device="cpu"),
    )
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape)
        p.grad_added_to_main_grad = False
    reference = to_reference(model)
    megatron = MegatronDDPHooks(model)
    xs, gys = make_data(2, (4, D), D)
    for x, gy in zip(xs, gys):  # two steps, one micro-batch each
        for p in model.parameters():
            p.grad_added_to_main_grad = False
        model(x).backward(gy)
        model[1].backward_dw()
        model[0].backward_dw()
        sent = megatron.finish_grad_sync()
        reference(x).backward(gy)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(sent[id(p)], q.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_reduce_hooks_follow_retying():
    """Hooks registered before tying follow the parameter the layer holds afterwards, and fire
    after the last tied layer's deferred work."""
    model = nn.Sequential(linear(True, name="a"), nn.Tanh(), linear(True, name="b"))
    reference_before = model[2].weight
    rec = Recorder()
    model[2].register_wgrad_accumulation_and_reduce_hooks(rec.hook("b-hook"))
    model[2].weight = model[0].weight  # tie after registration
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (4, D), D)
    model(x).backward(gy)
    reference(x).backward(gy)
    rec.mark("W", "b")
    model[2].backward_dw()
    rec.mark("W", "a")
    model[0].backward_dw()
    # the bias fires after b's W; the (now shared) weight only after a's W
    assert rec.labels() == [("W", "b"), ("hook", "b-hook"), ("W", "a"), ("hook", "b-hook")]
    assert reference_before.grad is None
    torch.testing.assert_close(rec.hook_grads("b-hook")[0], reference[2].bias.grad, rtol=0, atol=0)
    torch.testing.assert_close(rec.hook_grads("b-hook")[1], reference[0].weight.grad, rtol=0, atol=0)
    assert_grads_match(model, reference, exact=True)


def test_hook_that_raises_loses_no_gradient():
    """A reducer hook that raises: the exception reaches the caller of backward_dw_all(), with its
    type; the gradient it was told about has landed, the other hooks of that parameter set ran,
    and the work not yet run stays queued and runs next time."""
    model = nn.Sequential(linear(True, name="first"), nn.Tanh(), linear(True, name="last"))
    reference = to_reference(model)
    calls = []

    def failing(param):
        calls.append("failing")
        raise ValueError("all-reduce failed")

    splitgrad.register_grad_ready_hook(model[2].weight, failing)
    splitgrad.register_grad_ready_hook(model[2].bias, lambda p: calls.append("bias"))
    (x,), (gy,) = make_data(1, (4, D), D)
    model(x).backward(gy)
    reference(x).backward(gy)
    # the last layer's backward ran first, so its item is the oldest: it runs first
    with pytest.raises(ValueError, match="all-reduce failed"):
        splitgrad.backward_dw_all()
    assert calls == ["failing", "bias"]
    assert model[2].weight.grad is not None and model[2].bias.grad is not None
    assert splitgrad.layers_with_pending_wgrads() == ["first"]
    splitgrad.backward_dw_all()
    assert_grads_match(model, reference, exact=True)


# ------------------------------------------------------------------------------------------------
# Activation checkpointing (non-reentrant: one graph task, recomputation inside it)
# ------------------------------------------------------------------------------------------------


def test_non_reentrant_checkpoint_exact_and_hook_once():
    """Delayed layers inside torch.utils.checkpoint(use_reentrant=False), with a weight tied to a
    layer outside the checkpointed region: gradients are exact and the shared weight's hook fires
    once per pass, after the last backward_dw()."""
    from torch.utils.checkpoint import checkpoint

    class Model(nn.Module):
        def __init__(self, make):
            super().__init__()
            self.inner = make(8, 8)
            self.outer = make(8, 8)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.inner(t)), x, use_reentrant=False)
            return self.outer(h)

    model = Model(lambda i, o: splitgrad.Linear(i, o, device="cpu", delay_wgrad_compute=True))
    model.outer.weight = model.inner.weight
    reference = to_reference(model)
    events = []
    splitgrad.register_grad_ready_hook(model.inner.weight, lambda p: events.append("hook"))
    x = torch.randn(5, 8)
    for _ in range(2):
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        events.append("backward")
        model.outer.backward_dw()
        events.append("W outer")
        model.inner.backward_dw()
        events.append("W inner")
    # The hook runs inside the last backward_dw() of each pass (when the last contribution lands),
    # so it is recorded before "W inner" is appended.
    assert events == ["backward", "W outer", "hook", "W inner"] * 2
    assert_grads_match(model, reference, exact=False)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_checkpointed_layers_get_exact_gradients(use_reentrant, delay):
    """Checkpointing recomputes the forward in the backward and hands the layer recomputed saved
    tensors: the gradients must still reach the parameters themselves (bit-exact on the CPU)."""
    from torch.utils.checkpoint import checkpoint

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=delay)
            self.outer = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=delay)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.inner(t)), x, use_reentrant=use_reentrant)
            return self.outer(h)

    model = Model()
    reference = to_reference(model)
    x = torch.randn(5, 8, requires_grad=True)
    model(x).square().sum().backward()
    backward_dw_each(model)
    reference(x).square().sum().backward()
    assert_grads_match(model, reference, exact=True)
