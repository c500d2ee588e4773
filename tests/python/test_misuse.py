"""SPEC §3: misuse gets a clear error, and no gradient is lost. One test per row."""

import gc
import re
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import splitgrad
from sg_helpers import (assert_grads_match, backward_dw_each, gradient_of, make_data, to_reference,
                        unwritable_grad)

D = 8


def linear(delay=True, **kw):
    return splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=delay, **kw)


# ------------------------------------------------------------------------------------------------
# backward_dw() with nothing pending / on a regular layer
# ------------------------------------------------------------------------------------------------


def test_backward_dw_after_a_pass_that_deferred_nothing_says_why():
    """Frozen parameters (LoRA-style fine-tuning) leave a delayed layer nothing to defer: the
    gradients of the pass are complete at once, and backward_dw() says why nothing is pending."""
    layer = linear(True, name="frozen.fc")
    layer.requires_grad_(False)
    x = torch.randn(3, D, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and splitgrad.pending_wgrads() == 0
    with pytest.raises(RuntimeError, match=r"'frozen\.fc'.*no backward pass has queued.*frozen parameters"):
        layer.backward_dw()


def test_backward_dw_with_nothing_pending_names_the_layer():
    layer = linear(True, name="encoder.fc1")
    with pytest.raises(RuntimeError, match=r"'encoder\.fc1'.*no backward pass has queued"):
        layer.backward_dw()
    # after the queued work has run, there is nothing pending again
    (x,), (gy,) = make_data(1, (3, D), D)
    layer(x).backward(gy)
    layer.backward_dw()
    with pytest.raises(RuntimeError, match=r"'encoder\.fc1'"):
        layer.backward_dw()
    # a forward without backward queues nothing
    layer(x)
    with pytest.raises(RuntimeError, match=r"'encoder\.fc1'"):
        layer.backward_dw()


def test_backward_dw_on_regular_layer_is_a_no_op():
    model = nn.Sequential(linear(False))
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (3, D), D)
    model(x).backward(gy)
    reference(x).backward(gy)
    before = [p.grad.clone() for p in model.parameters()]
    model[0].backward_dw()
    model[0].backward_dw()
    assert splitgrad.pending_wgrads() == 0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.grad, b)
    assert_grads_match(model, reference, exact=True)


# ------------------------------------------------------------------------------------------------
# stashed tensors modified in place
# ------------------------------------------------------------------------------------------------


class ParallelReuse(nn.Module):
    """One layer applied to two inputs in one forward: one pass, two deferred items."""

    def __init__(self):
        super().__init__()
        self.fc = linear(True, name="reused")

    def forward(self, x1, x2):
        return self.fc(x1) + self.fc(x2)


def test_inplace_modified_input():
    """The input of one of a pass's two items is modified in place: backward_dw() raises naming the
    layer and the input, and says that the pass's other item was dropped too: it runs a pass's
    items all or none, so no gradient of that pass is half-written and nothing of it stays queued
    for the next backward_dw(). Grad-ready hooks do not fire for the incomplete pass. The store
    stays usable: the next pass runs normally with one backward_dw()."""
    model = ParallelReuse()
    hook_calls = []
    splitgrad.register_grad_ready_hook(model.fc.weight, hook_calls.append)
    (x1, x2), _ = make_data(2, (3, D), D)
    gy = torch.randn(3, D)
    model(x1, x2).backward(gy)
    assert model.fc.pending_wgrads() == 2
    x1.mul_(2)  # the stashed input of the first application
    with pytest.raises(RuntimeError, match=r"'reused'.*input.*modified in place.* The other 1 deferred item\(s\) "
                                           r"that backward pass queued for this layer were dropped too"):
        model.fc.backward_dw()
    assert model.fc.weight.grad is None and model.fc.bias.grad is None
    assert model.fc.pending_wgrads() == 0 and splitgrad.pending_wgrads() == 0
    assert splitgrad._C.dropped_wgrads_for(model.fc.weight) == 2  # both items, reported
    assert hook_calls == []  # that pass's gradient is incomplete: its reducers must not run
    reference = to_reference(model)
    model(x1, x2).backward(gy)
    reference(x1, x2).backward(gy)
    model.fc.backward_dw()
    assert_grads_match(model, reference, exact=True)
    assert hook_calls == [model.fc.weight]


def test_inplace_modified_grad_output():
    """The grad_output stashed for a pass is modified in place: RuntimeError naming the layer and
    grad_output, no gradient written; the other micro-batch's item (taken in the same
    backward_dw_all call) goes back on the queue and runs next time."""
    model = nn.Sequential(linear(True, name="head"))
    reference = to_reference(model)
    xs, gys = make_data(2, (3, D), D)
    model(xs[0]).backward(gys[0])
    model(xs[1]).backward(gys[1])
    gys[0].add_(1.0)
    with pytest.raises(RuntimeError, match=r"'head'.*grad_output.*modified in place"):
        splitgrad.backward_dw_all()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert splitgrad.pending_wgrads() == 1
    splitgrad.backward_dw_all()
    reference(xs[1]).backward(gys[1])  # only micro-batch 1's contribution landed
    assert_grads_match(model, reference, exact=True)


# ------------------------------------------------------------------------------------------------
# optimizer.zero_grad() / optimizer.step() / Module.zero_grad() / state_dict() / gradient clipping
# / AMP's unscale_ with work pending
# ------------------------------------------------------------------------------------------------

ACTIONS = {
    "optimizer.step": lambda model, opt: opt.step(),
    "optimizer.zero_grad": lambda model, opt: opt.zero_grad(),
    "module.zero_grad": lambda model, opt: model.zero_grad(),
    "state_dict": lambda model, opt: model.state_dict(),
    "optimizer.state_dict": lambda model, opt: opt.state_dict(),
    # clipping partial gradients: limits far above the gradients, so a clip changes no value
    "clip_grad_norm_": lambda model, opt: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9),
    "clip_grad_value_": lambda model, opt: torch.nn.utils.clip_grad_value_(parameters=model.parameters(),
                                                                           clip_value=1e9),
    "clip_grads_with_norm_": lambda model, opt: torch.nn.utils.clip_grads_with_norm_(
        list(model.parameters()), 1e9, torch.tensor(1.0)),
    # AMP: unscaling partial gradients (a scale of 1, so an unscale changes no value); step()
    # unscales first
    "GradScaler.unscale_": lambda model, opt: _scaler().unscale_(opt),
    "GradScaler.step": lambda model, opt: _scaler().step(opt),
}


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))  # as after scaler.scale(loss)
    return scaler


def _pending_model():
    """Three layers (two delayed) after a backward pass, their deferred work pending. Returns the
    model, its reference (same pre-existing gradients) and a reference without them."""
    model = nn.Sequential(linear(True, name="blocks.0.fc"), nn.Tanh(), linear(False, name="blocks.1.fc"),
                          nn.Tanh(), linear(True, name="blocks.2.fc"))
    fresh = to_reference(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # earlier micro-batches' gradients
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (3, D), D)
    for m in (model, reference, fresh):
        m(x).backward(gy)
    return model, reference, fresh


@pytest.mark.parametrize("action", list(ACTIONS))
def test_pending_work_warns(action):
    """Policy "warn": a PendingWgradWarning naming exactly the layers with pending work; the work
    stays queued and still lands afterwards."""
    model, reference, fresh = _pending_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.warns(splitgrad.PendingWgradWarning) as record:
        ACTIONS[action](model, opt)
    messages = " ".join(str(w.message) for w in record)
    assert "'blocks.0.fc'" in messages and "'blocks.2.fc'" in messages
    assert "'blocks.1.fc'" not in messages
    assert splitgrad.pending_wgrads() == 2
    backward_dw_each(model)
    if action in ("optimizer.zero_grad", "module.zero_grad"):
        # the caller cleared the gradients: what lands afterwards is the deferred work alone
        fresh[2].weight.grad = fresh[2].bias.grad = None
        assert_grads_match(model, fresh, exact=True)
    else:
        assert_grads_match(model, reference, exact=True)


@pytest.mark.parametrize("action", list(ACTIONS))
def test_pending_work_errors(action):
    """Policy "error": a PendingWgradError naming the layers; nothing was changed."""
    model, reference, _ = _pending_model()
    splitgrad.set_pending_work_policy("error")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(splitgrad.PendingWgradError, match=r"'blocks\.(0|2)\.fc'"):
        ACTIONS[action](model, opt)
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
    assert splitgrad.pending_wgrads() == 2
    splitgrad.set_pending_work_policy("warn")
    backward_dw_each(model)
    assert_grads_match(model, reference, exact=True)  # no gradient was touched


def test_no_warning_without_pending_work_or_for_unrelated_params():
    splitgrad.set_pending_work_policy("error")
    model, _, _ = _pending_model()
    other = nn.Linear(D, D)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()  # its parameters have no pending work
        opt.step()
        other.zero_grad()
        other.state_dict()
        opt.state_dict()
        other(torch.randn(2, D)).sum().backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
        torch.nn.utils.clip_grad_value_(other.weight, 1.0)
        _scaler().unscale_(opt)
        model[2].state_dict()  # the regular layer has nothing pending
        backward_dw_each(model)
        model.zero_grad()
        model.state_dict()


def test_pending_work_policy_rejects_unknown_values():
    with pytest.raises(ValueError, match="warn"):
        splitgrad.set_pending_work_policy("ignore")
    assert splitgrad.get_pending_work_policy() == "warn"


# ------------------------------------------------------------------------------------------------
# fuse_wgrad_accumulation=True without a valid main_grad
# ------------------------------------------------------------------------------------------------

BAD_MAIN_GRADS = {
    "missing": (lambda p: None, r"needs {what}\.main_grad.*not set"),
    "wrong-shape": (lambda p: torch.zeros(p.shape[0] + 1, *p.shape[1:]),
                    r"expected {what}\.main_grad of shape \[{shape}\].*got \[{bad}\]"),
    "wrong-dtype": (lambda p: torch.zeros(p.shape, dtype=torch.bfloat16),
                    r"expected {what}\.main_grad of dtype torch\.float32, got torch\.bfloat16"),
}


# A bias without main_grad is valid (its gradient goes to bias.grad, as in te.Linear): see
# test_fused_bias_without_main_grad_uses_grad.
INVALID_MAIN_GRADS = [(bad, what) for what in ("weight", "bias") for bad in BAD_MAIN_GRADS
                      if (bad, what) != ("missing", "bias")]


@pytest.mark.parametrize("bad,what", INVALID_MAIN_GRADS)
@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_fused_without_valid_main_grad(bad, what, delay):
    layer = linear(delay, fuse_wgrad_accumulation=True, name="fused")
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape)
    param = getattr(layer, what)
    make, pattern = BAD_MAIN_GRADS[bad]
    if make(param) is None:
        del param.main_grad
    else:
        param.main_grad = make(param)
    shape = ", ".join(map(str, param.shape))
    bad_shape = ", ".join(map(str, [param.shape[0] + 1, *param.shape[1:]]))
    pattern = pattern.format(what=what, shape=shape, bad=bad_shape)
    x = torch.randn(3, D)
    for kind in (splitgrad.MainGradError, ValueError, RuntimeError):
        with pytest.raises(kind, match=r"'fused'.*" + pattern):
            layer(x)
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_fused_bias_without_main_grad_uses_grad(delay):
    """As te.Linear: with fuse_wgrad_accumulation the weight's gradient goes to weight.main_grad; a
    bias without a main_grad gets its gradient in bias.grad, equal to plain autograd's."""
    layer = linear(delay, fuse_wgrad_accumulation=True, name="fused")
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    reference = nn.Linear(D, D)
    reference.load_state_dict(layer.state_dict())
    x, gy = torch.randn(3, D), torch.randn(3, D)
    layer(x).backward(gy)
    layer.backward_dw()
    reference(x).backward(gy)
    assert layer.weight.grad is None
    torch.testing.assert_close(layer.weight.main_grad, reference.weight.grad)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# wrong input shape / dtype
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_wrong_input_width(delay):
    layer = splitgrad.Linear(D, 4, device="cpu", delay_wgrad_compute=delay, name="proj")
    for kind in (splitgrad.ArgumentError, ValueError, RuntimeError):
        with pytest.raises(kind, match=re.escape(f"'proj': expected input of shape [*, {D}]")
                           + r".*got shape \[2, 3, 5\]"):
            layer(torch.randn(2, 3, 5))
    with pytest.raises(splitgrad.ArgumentError, match=r"got shape \[\]"):
        layer(torch.tensor(1.0))


def test_weight_replaced_by_one_of_another_shape_is_named():
    """The bias no longer fits the weight: the message shows the weight's shape too, since the
    weight is what changed."""
    layer = splitgrad.Linear(D, 4, device="cpu", name="proj")
    layer.weight = nn.Parameter(torch.randn(5, D))
    with pytest.raises(splitgrad.ArgumentError, match=re.escape("'proj': expected a bias of shape [5] (the weight's "
                                                                f"out_features, weight of shape [5, {D}]), got "
                                                                "shape [4]")):
        layer(torch.randn(3, D))


@pytest.mark.parametrize("delay", [True, False], ids=["delayed", "regular"])
def test_wrong_input_dtype(delay):
    layer = splitgrad.Linear(D, 4, device="cpu", delay_wgrad_compute=delay, name="proj",
                             params_dtype=torch.bfloat16)
    for kind in (splitgrad.DTypeError, TypeError, RuntimeError):
        with pytest.raises(kind, match=r"'proj': expected input of dtype torch\.bfloat16.*got torch\.float32"):
            layer(torch.randn(3, D))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([1.0] * D)


# ------------------------------------------------------------------------------------------------
# a layer deleted with work pending
# ------------------------------------------------------------------------------------------------


def test_layer_deleted_with_pending_work():
    """A warning that names the deleted layer; its stashed tensors are freed; its items leave the
    queue; a layer it was tied to keeps its own work, which still runs exactly."""
    model = nn.Sequential(linear(True, name="keep"), linear(True, name="doomed"))
    model[1].weight = model[0].weight
    x = torch.randn(3, D)
    gy = torch.randn(3, D)
    h = model[0](x)
    stashed = StorageWeakRef(h.untyped_storage())  # the doomed layer's stashed input (its values)
    model[1](h).backward(gy)
    assert splitgrad.pending_wgrads() == 2
    keep_layer = model[0]
    reference = to_reference(nn.Sequential(keep_layer))
    grad_h = torch.mm(gy, model[1].weight.detach())  # what reached layer 0 (its grad_output)
    reference(x).backward(grad_h)
    del h
    assert not stashed.expired()
    with pytest.warns(splitgrad.PendingWgradWarning, match=r"'doomed'.*deleted with 1 deferred"):
        del model[1]
        gc.collect()
    assert stashed.expired()
    assert splitgrad.pending_wgrads() == 1
    assert splitgrad.layers_with_pending_wgrads() == ["keep"]
    keep_layer.backward_dw()
    assert_grads_match(nn.Sequential(keep_layer), reference, exact=True)


def _doomed_grouped():
    experts = splitgrad.GroupedLinear(4, D, D, device="cpu", delay_wgrad_compute=True, name="doomed")
    experts.weight2 = experts.weight3 = experts.weight0  # tied three times: the sum's order matters
    return experts


DOOMED = {  # a delayed layer, and how to apply it
    "Linear": (lambda: linear(True, name="doomed"), lambda m, h: m(h)),
    "Linear-fused": (lambda: linear(True, name="doomed", fuse_wgrad_accumulation=True), lambda m, h: m(h)),
    "LayerNormMLP": (lambda: splitgrad.LayerNormMLP(D, 2 * D, device="cpu", delay_wgrad_compute=True, name="doomed"),
                     lambda m, h: m(h)),
    "GroupedLinear-tied": (_doomed_grouped, lambda m, h: m(h, [2, 1, 0, 3])),
}


@pytest.mark.parametrize("kind", list(DOOMED))
def test_layer_deleted_between_forward_and_backward(kind):
    """A delayed layer that is garbage before its backward pass, its parameters still alive (held
    by an optimizer, say): nothing could run deferred work of it later, so its backward computes
    and adds its weight gradients at once, as the regular path (main_grad included) and nn.Linear
    do. Every gradient equals plain autograd's bit for bit, without a warning; nothing of it is
    queued, and its parameters' grad-ready hooks fire for that pass."""
    build, apply = DOOMED[kind]
    model = nn.Sequential(linear(True, name="kept"), nn.Tanh())
    doomed = build()
    if kind == "Linear-fused":
        for p in doomed.parameters():
            p.main_grad = torch.randn(p.shape)  # added to, as the .grad of the reference
    reference, doomed_ref = to_reference(model), to_reference(doomed)
    params = dict(doomed.named_parameters())
    fired = []
    for name, p in params.items():
        splitgrad.register_grad_ready_hook(p, lambda _, name=name: fired.append(name))
    x = torch.randn(6, D, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    gy = torch.randn(6, D)
    y = apply(doomed, model(x))
    y_ref = apply(doomed_ref, reference(x_ref))
    del doomed
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y.backward(gy)
    y_ref.backward(gy)
    assert splitgrad.pending_wgrads() == 1  # the kept layer's work only
    assert sorted(fired) == sorted(params)
    model[0].backward_dw()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    assert_grads_match(model, reference, exact=True)
    for name, p in params.items():
        got = p.main_grad if kind == "Linear-fused" else p.grad
        want = dict(doomed_ref.named_parameters())[name].grad
        assert got is not None, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
        if kind == "Linear-fused":
            assert p.grad is None, name


@pytest.mark.parametrize("bad", ["weight", "bias"])
def test_an_unwritable_grad_writes_nothing_of_the_item(bad):
    """A kept .grad that cannot be added to in place (made under inference mode): backward_dw()
    raises naming the layer and the parameter before writing anything (the weight's .grad was
    written before the bias's in-place add failed); the item is dropped, both .grads as they were."""
    layer = linear(True, name="blocks.0.fc")
    for name, p in layer.named_parameters():
        p.grad = unwritable_grad(p, "inference") if name == bad else torch.randn_like(p)
    before = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer(torch.randn(3, D)).sum().backward()
    with pytest.raises(RuntimeError, match=rf"'blocks\.0\.fc'.*\.grad of {bad}: it is an inference tensor"):
        layer.backward_dw()
    assert layer.pending_wgrads() == 0
    for name, p in layer.named_parameters():
        assert splitgrad._C.dropped_wgrads_for(p) == 1, name
        torch.testing.assert_close(p.grad, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("how", ["inference", "expanded"])
@pytest.mark.parametrize("module", ["Linear", "GroupedLinear"])
def test_fused_layer_with_an_unwritable_bias_grad_writes_nothing(module, how):
    """fuse_wgrad_accumulation=True without delay: the weights' gradients go to main_grad at once
    and a bias without one to its .grad. A bias .grad that cannot be added to in place stops the
    backward with an error naming the layer and the bias, before any main_grad or other .grad is
    written (the inference tensor itself is left as it was)."""
    if module == "Linear":
        layer = splitgrad.Linear(D, D, device="cpu", fuse_wgrad_accumulation=True, name="fused")
        bad, args, x = "bias", (), torch.randn(4, D)
    else:
        layer = splitgrad.GroupedLinear(3, D, D, device="cpu", fuse_wgrad_accumulation=True,
                                        name="fused")
        bad, args, x = "bias1", ([1, 2, 1],), torch.randn(4, D)
    params = dict(layer.named_parameters())
    for name, p in params.items():
        if name.startswith("weight"):
            p.main_grad = torch.zeros(p.shape)
        else:
            p.grad = unwritable_grad(p, how) if name == bad else torch.randn_like(p)
    before = {name: gradient_of(p).clone() for name, p in params.items()}
    match = "inference tensor" if how == "inference" else "share memory"
    with pytest.raises(RuntimeError, match=rf"'fused'.*fused weight gradient cannot add to the "
                                           rf"\.grad of {bad}: .*{match}"):
        layer(x, *args).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(gradient_of(p), before[name], rtol=0, atol=0, msg=name)


def test_layer_deleted_with_work_queued_keeps_dropping_it():
    """Work already queued when its layer is deleted cannot land anywhere it was asked to go later:
    its stash is freed and it is reported (a PendingWgradWarning naming the layer; the parameters'
    hooks skip that pass), as before."""
    doomed = linear(True, name="doomed")
    weight = doomed.weight
    fired = []
    splitgrad.register_grad_ready_hook(weight, fired.append)
    doomed(torch.randn(3, D)).sum().backward()
    with pytest.warns(splitgrad.PendingWgradWarning, match="'doomed' was deleted with 1 deferred"):
        del doomed
        gc.collect()
    assert splitgrad.pending_wgrads() == 0 and weight.grad is None and fired == []
    assert splitgrad._C.dropped_wgrads_for(weight) == 1
