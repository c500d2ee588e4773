"""SPEC §2: the Python API — te.Linear's constructor keywords, module behaviour (state_dict, .to,
deepcopy), name_layers, and ``import splitgrad as te`` as a drop-in."""

import contextlib
import copy
import gc
import inspect
import io
import math
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import splitgrad
import splitgrad as te
from sg_helpers import assert_grads_match, backward_dw_each, make_data, to_reference

TE_KEYWORDS = ("params_dtype", "device", "delay_wgrad_compute", "fuse_wgrad_accumulation", "init_method")


def test_constructor_defaults():
    layer = splitgrad.Linear(8, 4)
    assert (layer.in_features, layer.out_features) == (8, 4)
    assert layer.weight.shape == (4, 8) and layer.bias.shape == (4,)
    assert layer.delay_wgrad_compute is False and layer.fuse_wgrad_accumulation is False
    assert layer.weight.dtype == torch.get_default_dtype() == layer.bias.dtype
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert layer.weight.device.type == expected_device
    assert layer.name == f"Linear(8, 4)#{layer._layer_id}"
    # nn.Linear's initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias
    bound = 1 / math.sqrt(8)
    assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
    assert layer.pending_wgrads() == 0


def test_constructor_keywords():
    seen = []
    layer = splitgrad.Linear(8, 4, bias=False, params_dtype=torch.bfloat16, device="cpu",
                             delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                             init_method=lambda w: (seen.append(w), nn.init.ones_(w)), name="fc")
    assert layer.bias is None
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.device.type == "cpu"
    assert layer.delay_wgrad_compute and layer.fuse_wgrad_accumulation and layer.name == "fc"
    assert seen == [layer.weight] and torch.equal(layer.weight, torch.ones_like(layer.weight))
    text = repr(layer)
    assert "delay_wgrad_compute=True" in text and "'fc'" in text
    params = inspect.signature(splitgrad.Linear).parameters
    for keyword in TE_KEYWORDS:
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY
    forward_params = inspect.signature(splitgrad.Linear.forward).parameters
    assert forward_params["is_first_microbatch"].default is None


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="sequence_parallel"):
        splitgrad.Linear(8, 4, sequence_parallel=True)
    with pytest.raises(TypeError, match="not_a_keyword"):
        splitgrad.Linear(8, 4, not_a_keyword=1)


class _RngTracker:
    """Megatron's CudaRNGStatesTracker as TE calls it: fork(name) around the weights' init."""

    def __init__(self):
        self.forks = []

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forks.append(name)
        state = torch.get_rng_state()
        torch.manual_seed(1234)  # the tracker's own stream
        try:
            yield
        finally:
            torch.set_rng_state(state)


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_megatron_tensor_parallel_keywords_at_one_rank(module):
    """Megatron's TE layers pass parallel_mode and its RNG tracker even at tensor-parallel size 1:
    accepted, the weights drawn under the tracker's fork as TE draws them; tensor or sequence
    parallelism itself is refused by name."""
    make = {
        "Linear": lambda **kw: splitgrad.Linear(8, 4, device="cpu", **kw),
        "LayerNormLinear": lambda **kw: splitgrad.LayerNormLinear(8, 4, device="cpu", **kw),
        "LayerNormMLP": lambda **kw: splitgrad.LayerNormMLP(8, 4, device="cpu", **kw),
        "GroupedLinear": lambda **kw: splitgrad.GroupedLinear(2, 8, 4, device="cpu", **kw),
    }[module]
    mode = {"set_parallel_mode": True} if module == "LayerNormMLP" else {"parallel_mode": "row"}
    tracker = _RngTracker()
    torch.manual_seed(0)
    layer = make(tp_size=1, tp_group=None, sequence_parallel=False, get_rng_state_tracker=lambda: tracker,
                 rng_tracker_name="expert-rng", **mode)
    assert tracker.forks == ["expert-rng"]
    torch.manual_seed(0)
    again = make(get_rng_state_tracker=lambda: tracker)  # the tracker's stream again: the same weights
    assert tracker.forks == ["expert-rng", "model-parallel-rng"]
    for (name, p), (_, q) in zip(layer.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    torch.manual_seed(0)
    untracked = make()
    assert any(not torch.equal(p, q) for p, q in zip(layer.parameters(), untracked.parameters()))
    assert layer.tp_size == 1 and layer.sequence_parallel is False
    with pytest.raises(TypeError, match="tensor parallelism is not supported: expected tp_size=1 .* got tp_size=2"):
        make(tp_size=2)
    with pytest.raises(TypeError, match="sequence parallelism is not supported"):
        make(sequence_parallel=True)
    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        make(get_rng_state_tracker="tracker")
    if module != "LayerNormMLP":
        with pytest.raises(TypeError, match="expected parallel_mode None, 'column' or 'row'"):
            make(parallel_mode="diagonal")


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_te_forward_fp8_keywords_accepted_off(module):
    layer = (splitgrad.Linear(8, 4, device="cpu") if module == "Linear"
             else splitgrad.LayerNormLinear(8, 4, device="cpu"))
    x = torch.randn(3, 8)
    assert torch.equal(layer(x, None, False, False), layer(x))
    assert torch.equal(layer(x, fp8_output=False, fp8_grad=False), layer(x))
    with pytest.raises(splitgrad.ArgumentError, match="FP8 is not supported: expected fp8_output=False"):
        layer(x, fp8_output=True)
    with pytest.raises(splitgrad.ArgumentError, match="fp8_grad=True"):
        layer(x, fp8_grad=True)


# te.Linear's (TE 2.x) keywords for features splitgrad does not have, at their defaults.
TE_LINEAR_OFF = dict(sequence_parallel=False, tp_group=None, tp_size=1, get_rng_state_tracker=None,
                     rng_tracker_name=None, parallel_mode=None, parameters_split=None, ub_overlap_ag=False,
                     ub_overlap_rs=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False, ub_bulk_wgrad=False,
                     ub_name=None, symmetric_ar_type=None, save_original_input=False)


def test_te_keywords_at_their_defaults_are_accepted():
    """TE code that spells out its off-by-default features runs unchanged."""
    layer = splitgrad.Linear(8, 4, device="cpu", **TE_LINEAR_OFF)
    assert layer(torch.randn(2, 8)).shape == (2, 4)
    for keyword, default in TE_LINEAR_OFF.items():
        splitgrad.Linear(8, 4, device="cpu", **{keyword: default})


@pytest.mark.parametrize("keyword,value", [("parameters_split", ("q", "k")), ("ub_overlap_rs_dgrad", True),
                                           ("ub_bulk_dgrad", True), ("ub_bulk_wgrad", True),
                                           ("symmetric_ar_type", "multimem_all_reduce"),
                                           ("save_original_input", True)])
def test_te_keywords_off_their_defaults_are_refused_by_name(keyword, value):
    with pytest.raises(TypeError, match=rf"splitgrad.Linear .*\['{keyword}'\]"):
        splitgrad.Linear(8, 4, device="cpu", **{keyword: value})


@pytest.mark.parametrize("delay", [False, True])
def test_return_bias_leaves_the_bias_to_the_caller(delay):
    """te.Linear's return_bias=True: forward returns (x·Wᵀ, b); the caller's add owns b's gradient."""
    layer = splitgrad.Linear(8, 4, device="cpu", return_bias=True, delay_wgrad_compute=delay)
    reference = nn.Linear(8, 4)
    reference.load_state_dict(layer.state_dict())
    x, gy = torch.randn(3, 8), torch.randn(3, 4)
    out, bias = layer(x)
    assert bias is layer.bias
    (out + bias).backward(gy)
    layer.backward_dw()
    reference(x).backward(gy)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


@pytest.mark.parametrize("args", [(0, 4), (8, -1), (8.0, 4), (True, 4)])
def test_bad_sizes(args):
    with pytest.raises(splitgrad.ArgumentError, match="positive int"):
        splitgrad.Linear(*args, device="cpu")


def test_bad_params_dtype():
    with pytest.raises(splitgrad.DTypeError, match="floating-point params_dtype"):
        splitgrad.Linear(8, 4, params_dtype=torch.int32, device="cpu")


def test_bad_is_first_microbatch():
    layer = splitgrad.Linear(8, 4, device="cpu")
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(torch.randn(2, 8), is_first_microbatch=1)


def test_state_dict_round_trip_with_nn_linear():
    layer = splitgrad.Linear(8, 4, device="cpu", delay_wgrad_compute=True)
    plain = nn.Linear(8, 4)
    assert list(layer.state_dict()) == list(plain.state_dict()) == ["weight", "bias"]
    layer.load_state_dict(plain.state_dict())
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    other = splitgrad.Linear(8, 4, device="cpu")
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.weight, plain.weight)


def test_to_dtype_keeps_tying():
    model = nn.Sequential(splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True), nn.Tanh(),
                          splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True))
    model[2].weight = model[0].weight
    model.to(torch.float64)
    assert model[2].weight is model[0].weight and model[0].weight.dtype == torch.float64
    reference = to_reference(model)
    (x,), (gy,) = make_data(1, (3, 8), 8, dtype=torch.float64)
    model(x).backward(gy)
    reference(x).backward(gy)
    backward_dw_each(model)
    assert_grads_match(model, reference, exact=True)


def test_deepcopy_is_an_independent_layer():
    """A copy has its own registration and pending queue, keeps tying within the copy, and its
    gradients are its own."""
    model = nn.Sequential(splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True, name="a"),
                          nn.Tanh(),
                          splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True, name="b"))
    model[2].weight = model[0].weight
    (x,), (gy,) = make_data(1, (3, 8), 8)
    model(x).backward(gy)  # pending work on the original
    clone = copy.deepcopy(model)
    assert clone[0]._layer_id != model[0]._layer_id
    assert clone[0].name == "a" and clone[2].weight is clone[0].weight
    assert clone[0].weight is not model[0].weight
    assert clone[0].pending_wgrads() == 0 and model[0].pending_wgrads() == 1
    with pytest.raises(RuntimeError, match="no backward pass has queued"):
        clone[0].backward_dw()
    backward_dw_each(model)  # the original's work lands on the original's parameters only
    assert all(p.grad is None for p in clone.parameters())
    reference = to_reference(clone)
    clone(x).backward(gy)
    reference(x).backward(gy)
    assert model[0].pending_wgrads() == 0 and clone[0].pending_wgrads() == 1
    backward_dw_each(clone)
    assert_grads_match(clone, reference, exact=True)


def test_deepcopy_keeps_reduce_hooks_on_its_own_parameters():
    layer = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda p: calls.append(p))
    clone = copy.deepcopy(layer)
    (x,), (gy,) = make_data(1, (3, 8), 8)
    clone(x).backward(gy)
    clone.backward_dw()
    assert sorted(map(id, calls)) == sorted([id(clone.weight), id(clone.bias)])


def test_name_layers():
    model = nn.Sequential(
        nn.ModuleDict({"attn": splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True),
                       "mlp": nn.Sequential(nn.Linear(8, 8), splitgrad.Linear(8, 8, device="cpu"))}))
    splitgrad.name_layers(model)
    assert model[0]["attn"].name == "0.attn" and model[0]["mlp"][1].name == "0.mlp.1"
    splitgrad.name_layers(model, prefix="decoder")
    assert model[0]["attn"].name == "decoder.0.attn"
    with pytest.raises(RuntimeError, match=r"'decoder\.0\.attn'"):
        model[0]["attn"].backward_dw()
    single = splitgrad.Linear(8, 8, device="cpu")
    splitgrad.name_layers(single)
    assert single.name == "Linear"


def test_drop_in_for_transformer_engine():
    """TE-style code: te.Linear, backward_dw(), fuse_wgrad_accumulation with Megatron's main_grad,
    the TE hook name; checked against plain autograd."""
    assert te.Linear is splitgrad.Linear
    for name in ("Linear", "backward_dw_all", "pending_wgrads", "register_grad_ready_hook"):
        assert hasattr(te, name) and name in te.__all__
    layer = te.Linear(8, 8, bias=True, params_dtype=torch.float32, device="cpu",
                      delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    reduced = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: reduced.append(True))
    reference = to_reference(layer)
    (x,), (gy,) = make_data(1, (2, 3, 8), 8)
    layer(x, is_first_microbatch=True).backward(gy)
    reference(x).backward(gy)
    layer.backward_dw()
    assert reduced == [True]  # TE calls a no-argument hook once per backward_dw() of the layer
    assert_grads_match(layer, reference, exact=False)


def test_exception_hierarchy():
    assert issubclass(splitgrad.ArgumentError, ValueError) and issubclass(splitgrad.ArgumentError, RuntimeError)
    assert issubclass(splitgrad.DTypeError, TypeError) and issubclass(splitgrad.DTypeError, RuntimeError)
    assert issubclass(splitgrad.MainGradError, splitgrad.ArgumentError)
    assert issubclass(splitgrad.PendingWgradError, RuntimeError)
    assert issubclass(splitgrad.PendingWgradWarning, UserWarning)


def test_pending_counts_and_layer_names():
    a = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True, name="a")
    b = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True, name="b")
    b.weight = a.weight
    x = torch.randn(2, 8)
    b(a(x)).sum().backward()
    b(x).sum().backward()
    assert splitgrad.pending_wgrads() == 3 and a.pending_wgrads() == 1 and b.pending_wgrads() == 2
    assert splitgrad.layers_with_pending_wgrads() == ["a", "b"]
    assert splitgrad.layers_with_pending_wgrads([b.bias]) == ["b"]
    assert splitgrad.layers_with_pending_wgrads([a.weight]) == ["a", "b"]
    assert splitgrad.layers_with_pending_wgrads([nn.Parameter(torch.zeros(1))]) == []
    b.backward_dw()
    assert b.pending_wgrads() == 1
    splitgrad.backward_dw_all()
    assert splitgrad.pending_wgrads() == 0


def test_backward_dw_all_of_one_model_runs_only_its_work():
    def model():
        return torch.nn.Sequential(splitgrad.Linear(4, 4, device="cpu", delay_wgrad_compute=True),
                                   splitgrad.Linear(4, 4, device="cpu", delay_wgrad_compute=True))

    a, b = model(), model()
    reference = copy.deepcopy(a)
    x = torch.randn(3, 4)
    for m in (a, b, reference):
        m(x).sum().backward()
    splitgrad.backward_dw_all(a.parameters())
    assert [layer.pending_wgrads() for m in (a, b, reference) for layer in m] == [0, 0, 1, 1, 1, 1]
    assert all(p.grad is None for p in b.parameters())
    splitgrad.backward_dw_all([])  # no parameters: nothing feeds them, nothing runs
    assert splitgrad.pending_wgrads() == 4
    for layer in reference:
        layer.backward_dw()
    for p, q in zip(a.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    splitgrad.backward_dw_all(b.parameters())
    assert splitgrad.pending_wgrads() == 0


def test_two_threads_each_run_their_own_models_work():
    models = [torch.nn.Sequential(splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True),
                                  splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True)) for _ in range(2)]
    references = [copy.deepcopy(m) for m in models]
    inputs = [[torch.randn(5, 8) for _ in range(20)] for _ in range(2)]
    errors = []

    def train(i):
        try:
            for x in inputs[i]:
                models[i](x).square().sum().backward()
                splitgrad.backward_dw_all(models[i].parameters())
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        for x in inputs[i]:
            references[i](x).square().sum().backward()
            for layer in references[i]:
                layer.backward_dw()
        for p, q in zip(models[i].parameters(), references[i].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_a_layers_backward_dw_waits_for_its_work_in_another_thread_without_holding_the_gil():
    """Thread A's backward_dw_all() holds l1's item while blocked in a hook; the main thread's
    l1.backward_dw() waits for it to land. It must wait without the GIL: A's hook and the freeing of
    its stashed tensors need it. Run in a subprocess, so that a deadlock fails the test."""
    script = textwrap.dedent("""
        import threading, torch, splitgrad
        l1 = splitgrad.Linear(8, 16, device="cpu", delay_wgrad_compute=True, name="l1")
        big = splitgrad.Linear(16, 16, device="cpu", delay_wgrad_compute=True, name="big")
        reference = [p.detach().clone().requires_grad_() for p in (l1.weight, l1.bias)]
        x = torch.randn(32, 8)
        big(l1(x)).sum().backward()  # queues big's item, then l1's
        entered, release = threading.Event(), threading.Event()
        def hook(param):
            entered.set()
            release.wait()
        handle = splitgrad.register_grad_ready_hook(big.weight, hook)
        a = threading.Thread(target=splitgrad.backward_dw_all)
        a.start()
        entered.wait()
        assert splitgrad.pending_wgrads() == 1 and l1.pending_wgrads() == 1
        threading.Timer(0.2, release.set).start()
        l1.backward_dw()  # waits for A to land l1's item
        assert l1.pending_wgrads() == 0
        a.join()
        y = torch.nn.functional.linear(x, *reference)
        (y @ big.weight.detach().t() + big.bias.detach()).sum().backward()
        torch.testing.assert_close(l1.weight.grad, reference[0].grad, rtol=0, atol=0)
        torch.testing.assert_close(l1.bias.grad, reference[1].grad, rtol=0, atol=0)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_grouped_backward_dw_in_threads_while_the_main_thread_calls_in_holding_the_gil():
    """backward_dw() takes the GIL for batches of reference work (its parameters' and main_grads'
    references) and must never wait for a splitgrad lock meanwhile: two threads run GroupedLinear
    layers' deferred work with grad-ready hooks while the main thread, holding the GIL, registers
    hooks and reads the pending counts in a loop. In a subprocess, so that a deadlock fails the
    test; every hook fires once per pass and the gradients equal autograd's."""
    script = textwrap.dedent("""
        import threading, torch, splitgrad
        torch.manual_seed(0)
        splits = [3, 0, 5, 2]
        layers = [splitgrad.GroupedLinear(4, 8, 8, device="cpu", delay_wgrad_compute=True,
                                          fuse_wgrad_accumulation=fused) for fused in (True, False)]
        for p in layers[0].parameters():
            p.main_grad = torch.zeros_like(p)
        references = [{n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
                      for layer in layers]
        inputs = [torch.randn(10, 8) for _ in range(60)]
        fired = {id(p): 0 for layer in layers for p in layer.parameters()}
        lock = threading.Lock()
        def count(param):
            with lock:
                fired[id(param)] += 1
        for layer in layers:
            for p in layer.parameters():
                splitgrad.register_grad_ready_hook(p, count)
        errors = []
        def train(layer):
            try:
                for x in inputs:
                    layer(x, splits).square().sum().backward()
                    splitgrad.backward_dw_all(layer.parameters())
            except Exception as error:
                errors.append(error)
        threads = [threading.Thread(target=train, args=(layer,)) for layer in layers]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            splitgrad.pending_wgrads()
            splitgrad.register_grad_ready_hook(layers[0].weight0, lambda p: None).remove()
        for t in threads:
            t.join()
        assert not errors, errors
        assert set(fired.values()) == {len(inputs)}, fired
        for layer, ref in zip(layers, references):
            for x in inputs:
                ys = [torch.nn.functional.linear(part, ref[f"weight{i}"], ref[f"bias{i}"])
                      for i, part in enumerate(x.split(splits))]
                torch.cat(ys).square().sum().backward()
            for name, p in layer.named_parameters():
                got = p.main_grad if hasattr(p, "main_grad") else p.grad
                torch.testing.assert_close(got, ref[name].grad, rtol=1e-5, atol=1e-5, msg=name)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("other", ["delayed", "fused"])
def test_backward_dw_all_in_threads_while_another_thread_runs_under_a_dispatch_mode(other):
    """Thread A's backward_dw_all() runs several items of its model (their .grads checked before
    any runs) while thread B trains its own model (delayed, or fused into main_grad) under a Python
    __torch_dispatch__ mode: B's gradient writes hold a parameter lock and wait for the GIL, so A
    must never wait for such a lock with the GIL held (the locks are striped by address: the two
    models share stripes). In a subprocess, so that a deadlock fails the test; the gradients equal
    autograd's."""
    script = textwrap.dedent(f"""
        import contextlib, threading, torch, splitgrad
        from torch.utils._python_dispatch import TorchDispatchMode
        class PassThrough(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {{}}))
        torch.manual_seed(0)
        D, L, STEPS = 16, 12, 60
        a = [splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True) for _ in range(L)]
        fused = {other == "fused"!r}
        b = [splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=not fused,
                              fuse_wgrad_accumulation=fused) for _ in range(L)]
        for layer in b if fused else []:
            layer.weight.main_grad = torch.zeros(D, D)
        params = [[p for layer in model for p in layer.parameters()] for model in (a, b)]
        refs = [[p.detach().clone().requires_grad_() for p in ps] for ps in params]
        inputs = [[torch.randn(4, D) for _ in range(STEPS)] for _ in range(2)]
        errors = []
        def train(model, ps, xs, mode):
            try:
                for x in xs:
                    with mode():
                        for layer in model:
                            x = layer(x)
                        x.square().sum().backward()
                        splitgrad.backward_dw_all(ps)
            except Exception as error:
                errors.append(error)
        threads = [threading.Thread(target=train, args=(a, params[0], inputs[0], contextlib.nullcontext)),
                   threading.Thread(target=train, args=(b, params[1], inputs[1], PassThrough))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for ps, rs, xs in zip(params, refs, inputs):
            for x in xs:
                for i in range(L):
                    x = torch.nn.functional.linear(x, rs[2 * i], rs[2 * i + 1])
                x.square().sum().backward()
            for i, (p, r) in enumerate(zip(ps, rs)):
                got = getattr(p, "main_grad", None)
                got = p.grad if got is None else got
                torch.testing.assert_close(got, r.grad, rtol=1e-5, atol=1e-5, msg=str(i))
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_a_finalizer_run_by_backward_dw_may_run_a_fused_backward():
    """backward_dw() frees an item's stash while it holds the GIL for the references; a finalizer
    on the stashed input then runs Python, here a fused layer's backward, which takes gradient
    locks (the autograd engine released the GIL on the way in): it runs, and writes its main_grad
    as autograd would."""
    delayed = splitgrad.Linear(4, 4, device="cpu", delay_wgrad_compute=True)
    fused = splitgrad.Linear(4, 4, device="cpu", fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.zeros(4, 4)
    fused_input = torch.randn(2, 4)
    outcome = []

    def run_fused_backward():
        try:
            fused(fused_input).sum().backward()
            outcome.append("ok")
        except Exception as error:  # reported below: a finalizer's exception is only printed
            outcome.append(error)

    x = torch.randn(3, 4)
    weakref.finalize(x, run_fused_backward)
    delayed(x).sum().backward()
    del x
    assert outcome == []
    delayed.backward_dw()
    assert outcome == ["ok"]
    torch.testing.assert_close(fused.weight.main_grad, torch.ones(4, 1) * fused_input.sum(0),
                               rtol=0, atol=0)


def test_a_layer_deleted_by_a_throwing_hook_while_its_item_is_in_flight_reports_the_item_dropped():
    """A grad-ready hook deletes layer B, then raises, inside backward_dw_all() while B's item is
    still to run: the item cannot go back on B's queue. It is reported as dropped (a warning, the
    ledger's counts), not lost silently, and B's weight (kept alive) gets its hooks for later
    passes."""
    a = splitgrad.Linear(4, 4, bias=False, device="cpu", delay_wgrad_compute=True, name="A")
    holder = {"b": splitgrad.Linear(4, 4, bias=False, device="cpu", delay_wgrad_compute=True, name="B")}
    weight = holder["b"].weight
    fired = []
    splitgrad.register_grad_ready_hook(weight, lambda p: fired.append(p))

    def delete_b_and_fail(param):
        holder.pop("b")
        gc.collect()
        raise RuntimeError("hook failure")

    handle = splitgrad.register_grad_ready_hook(a.weight, delete_b_and_fail)
    x = torch.randn(3, 4)
    a(holder["b"](x)).sum().backward()  # A's item queued before B's: A's runs (and its hook) first
    with pytest.warns(UserWarning, match="'B' was destroyed while its deferred wgrad work was running"):
        with pytest.raises(RuntimeError, match="hook failure"):
            splitgrad.backward_dw_all()
    handle.remove()
    assert splitgrad.pending_wgrads() == 0
    assert splitgrad._C.pending_wgrads_for(weight) == 0 and splitgrad._C.dropped_wgrads_for(weight) == 1
    assert weight.grad is None and fired == []
    (x @ weight.t()).sum().backward()  # a later pass through plain autograd
    assert len(fired) == 1 and fired[0] is weight


def test_items_of_a_deleted_layer_are_freed_without_holding_a_splitgrad_lock():
    """The same in a thread, with B's stash and main_grad held by Python (freeing them takes the
    GIL), while the main thread, holding the GIL, reads the pending count in a loop: the dropped
    item must be freed outside splitgrad's locks. In a subprocess, so a deadlock fails the test."""
    script = textwrap.dedent("""
        import threading, torch, splitgrad
        done, errors, kept = threading.Event(), [], []
        def one_round():
            a = splitgrad.Linear(16, 16, bias=False, delay_wgrad_compute=True, device="cpu")
            holder = {"b": splitgrad.Linear(16, 16, bias=False, delay_wgrad_compute=True,
                                            fuse_wgrad_accumulation=True, device="cpu")}
            weight = holder["b"].weight
            weight.main_grad = torch.zeros(16, 16)
            def hook(param):
                holder.pop("b", None)
                raise KeyError("hook failure")
            handle = splitgrad.register_grad_ready_hook(a.weight, hook)
            x = torch.randn(8, 16)
            a(holder["b"](x)).sum().backward()
            try:
                splitgrad.backward_dw_all(list(a.parameters()) + list(holder["b"].parameters()))
            except KeyError:
                pass
            handle.remove()
            kept.append((x, weight))  # Python keeps the stash and main_grad alive
        def worker():
            try:
                for _ in range(150):
                    one_round()
            except Exception as error:
                errors.append(error)
            finally:
                done.set()
        import warnings
        warnings.simplefilter("ignore")
        thread = threading.Thread(target=worker)
        thread.start()
        while not done.is_set():
            splitgrad.pending_wgrads()
        thread.join()
        assert not errors, errors
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("make", [
    lambda: splitgrad.Linear(4, 3, device="cpu"),
    lambda: splitgrad.LayerNormMLP(4, 8, device="cpu"),
    lambda: splitgrad.GroupedLinear(2, 4, 3, device="cpu"),
], ids=["Linear", "LayerNormMLP", "GroupedLinear"])
def test_a_te_checkpoint_with_extra_state_loads_strictly(make):
    # TE modules save an `_extra_state` entry (FP8 metadata; an empty tensor without FP8).
    source, target = make(), make()
    te_state = {f"block.{k}": v for k, v in source.state_dict().items()}
    te_state["block._extra_state"] = torch.empty(0)
    model = torch.nn.Sequential()
    model.add_module("block", target)
    model.load_state_dict(te_state, strict=True)
    for (name, p), q in zip(target.named_parameters(), source.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_fused_module_forward_without_grad_needs_no_main_grad(kind):
    """An eval or generation forward (no_grad, inference_mode) of a fused model from a checkpoint:
    no backward can follow, so no main_grad is needed (as in TE, which reads it in the backward),
    nothing is queued and grad_added_to_main_grad is not claimed; with grad mode on the missing
    main_grad is still a clear error."""
    kwargs = dict(fuse_wgrad_accumulation=True, delay_wgrad_compute=True, device="cpu")
    if kind == "GroupedLinear":
        module, args = splitgrad.GroupedLinear(2, 8, 6, **kwargs), (torch.randn(5, 8), [2, 3])
    else:
        module, args = getattr(splitgrad, kind)(8, 6, **kwargs), (torch.randn(5, 8),)
    for p in module.parameters():
        p.grad_added_to_main_grad = False
    outputs = []
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            outputs.append(module(*args))
        assert splitgrad.pending_wgrads() == 0
    assert not any(p.grad_added_to_main_grad for p in module.parameters())
    with pytest.raises(splitgrad.MainGradError, match="main_grad"):
        module(*args)
    assert splitgrad.pending_wgrads() == 0
    # The same output as a training forward (whose gradients the other tests hold to autograd's).
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape)
    trained = module(*args)
    trained = trained[0] if isinstance(trained, tuple) else trained
    trained.sum().backward()
    module.backward_dw()
    for out in outputs:
        assert torch.equal(out, trained.detach())
    if kind == "GroupedLinear":  # and per-expert F.linear's
        x = args[0]
        torch.testing.assert_close(outputs[0], torch.cat([F.linear(x[:2], module.weight0, module.bias0),
                                                          F.linear(x[2:], module.weight1, module.bias1)]).detach())


def _build(kind: str, **kw) -> nn.Module:
    if kind == "GroupedLinear":
        return splitgrad.GroupedLinear(3, 8, 6, **kw)
    return getattr(splitgrad, kind)(8, 6, **kw)


def _train_step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One SGD step (forward, backward, backward_dw for a delayed module, step); returns x.grad."""
    x = x.clone().requires_grad_(True)
    out = module(x, [1, 2, 2]) if isinstance(module, splitgrad.GroupedLinear) else module(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    module.backward_dw()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
    return x.grad


MODULES = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"]


def _init_methods(kind: str, init: str) -> dict:
    """TE's init keywords: Megatron's normal(0, 0.02) and a scaled one for the output layer."""
    if init == "default":
        return {}
    methods = {"init_method": lambda w: nn.init.normal_(w, std=0.02)}
    if kind == "LayerNormMLP":
        methods["output_layer_init_method"] = lambda w: nn.init.normal_(w, std=0.005)
    return methods


@pytest.mark.parametrize("kind", MODULES)
def test_init_method_draws_the_weights_and_zeroes_the_biases_as_te(kind):
    """TE (and Megatron over it) draws each GEMM weight by init_method and zeroes every GEMM bias;
    without one, the parameters are nn.Linear's (weights and biases within ±1/sqrt(in_features));
    reset_parameters(init_method=...) alike. The norm's parameters keep their defaults."""
    def gemm_params(module, part):
        return [(n, p) for n, p in module.named_parameters() if part in n and "layer_norm" not in n]

    seen = []
    module = _build(kind, device="cpu", init_method=lambda w: (seen.append(w), nn.init.constant_(w, 0.25)),
                    output_layer_init_method=lambda w: (seen.append(w), nn.init.constant_(w, -0.5))) \
        if kind == "LayerNormMLP" else \
        _build(kind, device="cpu", init_method=lambda w: (seen.append(w), nn.init.constant_(w, 0.25)))
    weights, biases = gemm_params(module, "weight"), gemm_params(module, "bias")
    assert [id(w) for w in seen] == [id(p) for _, p in weights]
    for name, w in weights:
        torch.testing.assert_close(w, torch.full_like(w, -0.5 if name == "fc2_weight" else 0.25), rtol=0, atol=0)
    assert biases and all(not b.any() for _, b in biases), [n for n, b in biases if b.any()]
    if "LayerNorm" in kind:
        assert torch.equal(module.layer_norm_weight, torch.ones(8)) and not module.layer_norm_bias.any()

    torch.manual_seed(0)
    default = _build(kind, device="cpu")
    params = dict(default.named_parameters())
    for name, b in gemm_params(default, "bias"):  # nn.Linear's: within ±1/sqrt(the weight's in_features)
        assert b.any() and b.abs().max() <= params[name.replace("bias", "weight")].shape[1] ** -0.5, name
    methods = {"init_method": nn.init.ones_}
    if kind == "LayerNormMLP":
        methods["output_layer_init_method"] = nn.init.ones_
    default.reset_parameters(**methods)
    assert all(not b.any() for _, b in gemm_params(default, "bias"))
    assert all(w.eq(1).all() for _, w in gemm_params(default, "weight"))


@pytest.mark.parametrize("init", ["default", "init_method"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("kind", MODULES)
def test_meta_device_context_then_to_empty_trains_like_an_eager_module(kind, delay, init):
    """``with torch.device("meta")`` (large-model init, as nn.Linear honours it): device=None takes
    the context's device, nothing is allocated; ``to_empty`` + ``reset_parameters`` then give the
    module an eager-built one gets (same seed; by the init_method given at construction, as TE
    keeps it), and it trains identically (bit for bit)."""
    with torch.device("meta"):
        lazy = _build(kind, delay_wgrad_compute=delay, **_init_methods(kind, init))
        plain = nn.Linear(8, 6)
    assert plain.weight.is_meta
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.reset_parameters()
    torch.manual_seed(0)
    eager = _build(kind, delay_wgrad_compute=delay, device="cpu", **_init_methods(kind, init))
    if init != "default":  # the methods drew the weights, not nn.Linear's bound of 1/sqrt(8)
        assert max(p.abs().max().item() for n, p in eager.named_parameters() if "weight" in n
                   and "layer_norm" not in n) < 0.15
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert p.device.type == "cpu"
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for _ in range(2):
        x = torch.randn(5, 8)
        torch.testing.assert_close(_train_step(lazy, x), _train_step(eager, x), rtol=0, atol=0)
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def _normal_init(w):  # module-level: pickles by name
    nn.init.normal_(w, std=0.02)


@pytest.mark.parametrize("kind", MODULES)
def test_a_module_with_an_init_method_still_saves_whole(kind):
    """torch.save(model) pickles the module: a kept init_method that pickles (a module-level
    function) is kept; a lambda or closure (Megatron's init_method_normal(sigma)) is left out, so the
    save works as for nn.Linear, and reset_parameters() of the loaded copy asks for it by name. A
    deep copy shares it."""
    for init, survives in ((_normal_init, True), (lambda w: nn.init.normal_(w, std=0.02), False)):
        module = _build(kind, device="cpu", init_method=init)
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for (name, p), q in zip(loaded.named_parameters(), module.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        if survives:
            loaded.reset_parameters()
        else:
            with pytest.raises(splitgrad.ArgumentError, match="init_method given at construction could not be pickled"):
                loaded.reset_parameters()
            loaded.reset_parameters(init_method=init)
        copy.deepcopy(module).reset_parameters()  # shares the kept method, whatever it is


@pytest.mark.parametrize("mode", ["delayed", "fused", "delayed+fused"])
@pytest.mark.parametrize("kind", MODULES)
def test_anomaly_detection_reports_a_nan_weight_gradient(kind, mode):
    """set_detect_anomaly(True, check_nan=True) stops plain autograd at a backward Function that
    returns a nan gradient; the gradients splitgrad writes itself (fused into main_grad, deferred to
    backward_dw()) are checked likewise: a RuntimeError, not a silent nan."""
    delay, fused = "delayed" in mode, "fused" in mode
    module = _build(kind, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused, device="cpu")
    if fused:
        for p in module.parameters():
            p.main_grad = torch.zeros_like(p)
    reference = to_reference(module)
    x = torch.randn(5, 8)
    x[2, 3] = float("nan")  # the output's nan is masked out: only the weight gradients see it

    def step(m, anomaly):
        with torch.autograd.set_detect_anomaly(anomaly, check_nan=True):
            out = m(x, [1, 2, 2]) if kind == "GroupedLinear" else m(x)
            out.nan_to_num(0.0).sum().backward()
            if m is module:
                module.backward_dw()

    with warnings.catch_warnings():  # anomaly mode's "Error detected in ..." (the engine's errors)
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="nan values"):
            step(reference, anomaly=True)
        with pytest.raises(RuntimeError, match="nan values") as info:
            step(module, anomaly=True)
        message = str(info.value)
        if kind in ("Linear", "GroupedLinear"):  # (a norm's backward sees the nan first in the others)
            assert ("backward_dw()" if delay else "the fused weight gradient") in message
            assert module.name in message
            # as autograd, which raises before AccumulateGrad: nothing of the nan gradient landed
            for name, p in module.named_parameters():
                if fused:
                    assert torch.equal(p.main_grad, torch.zeros_like(p)), name
                else:
                    assert p.grad is None, name
        del info, module  # the traceback holds the module; a norm's error left an item queued
        gc.collect()
    assert splitgrad.pending_wgrads() == 0
    module = _build(kind, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused, device="cpu")
    for p in module.parameters():
        p.main_grad = torch.zeros_like(p)
    step(module, anomaly=False)  # without anomaly detection: no check, as plain autograd
    assert any(not (p.main_grad if fused else p.grad).isfinite().all() for p in module.parameters()
               if (p.main_grad if fused else p.grad) is not None)


@pytest.mark.parametrize("kind", MODULES)
def test_to_empty_keeps_te_marks_and_reduce_hooks(kind):
    """to_empty() after a meta-device init makes new Parameter objects (not through __setattr__):
    TE's skip_backward_post_hook mark of a delayed module and the hooks registered before stay
    with the module's parameters."""
    with torch.device("meta"):
        lazy = _build(kind, delay_wgrad_compute=True)
    fired = []
    lazy.register_wgrad_accumulation_and_reduce_hooks(lambda p: fired.append(p))
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    params = list(lazy.parameters())
    gemm_params = [getattr(lazy, n) for n in lazy._deferred_parameter_names() if getattr(lazy, n, None) is not None]
    assert gemm_params and all(getattr(p, "skip_backward_post_hook", False) for p in gemm_params)
    _train_step(lazy, torch.randn(5, 8))
    assert sorted(map(id, fired)) == sorted(map(id, params))


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_anomaly_detection_blames_only_a_nan_a_gradient_did_not_hold_before(fused):
    """Autograd checks what a backward Function returns, not the accumulated .grad: a finite
    deferred (or fused) gradient added to a .grad/main_grad that already holds a nan is no error;
    a nan a deferred item brings stops it before its grad-ready hooks run (the items of later
    passes stay queued and run)."""
    layer = splitgrad.Linear(8, 6, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    for p in layer.parameters():
        if fused:
            p.main_grad = torch.zeros_like(p)
        else:
            p.grad = torch.zeros_like(p)
    buffer = layer.bias.main_grad if fused else layer.bias.grad
    buffer[0] = float("nan")
    fired = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda p: fired.append(p))
    with torch.autograd.set_detect_anomaly(True, check_nan=True):
        layer(torch.randn(4, 8)).sum().backward()
        layer.backward_dw()  # finite: no error although the buffer holds a nan
        assert len(fired) == 2
        bad = torch.randn(4, 8)
        bad[1, 2] = float("nan")
        layer(bad).nan_to_num(0.0).sum().backward()
        layer(torch.randn(4, 8)).sum().backward()
    before = [(p.main_grad if fused else p.grad).clone() for p in layer.parameters()]
    with pytest.raises(RuntimeError, match=r"backward_dw\(\) .* brought nan values into weight's " + ("main_grad" if fused else ".grad")):
        layer.backward_dw()
    for p, held in zip(layer.parameters(), before):  # put back: autograd raises before accumulating
        torch.testing.assert_close(p.main_grad if fused else p.grad, held, rtol=0, atol=0, equal_nan=True)
    assert len(fired) == 2, "the pass with the nan fires no grad-ready hook"
    assert splitgrad.pending_wgrads() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer.backward_dw()  # the later pass still runs (its buffer held a nan already: no error)
    assert len(fired) == 4


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_anomaly_detection_judges_each_entry_as_autograd_judges_the_gradient(fused):
    """Autograd checks the gradient a Function returns, entry by entry: a nan it brings next to one
    the buffer held is an error (the buffer put back), and +inf brought onto a held -inf is none
    (the sum is nan, as AccumulateGrad's)."""
    def build(held_entry, held_value):
        layer = splitgrad.Linear(4, 3, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused,
                                 device="cpu", name="fc")
        reference = to_reference(layer)
        for p, q in zip(layer.parameters(), reference.parameters()):
            buffer = torch.zeros_like(p)
            if p.dim() == held_entry[0]:
                buffer[held_entry[1]] = held_value
            if fused:
                p.main_grad = buffer
            else:
                p.grad = buffer
            q.grad = buffer.clone()
        return layer, reference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a nan in weight[0, 0] before; the gradient brings nans into other entries of the weight's
        layer, reference = build((2, (0, 0)), float("nan"))
        x = torch.randn(2, 4)
        x[1, 1] = float("nan")
        with torch.autograd.set_detect_anomaly(True, check_nan=True):
            with pytest.raises(RuntimeError, match="returned nan values"):
                reference(x).nan_to_num(0.0).sum().backward()
            layer(x).nan_to_num(0.0).sum().backward()
            before = [(p.main_grad if fused else p.grad).clone() for p in layer.parameters()]
            with pytest.raises(RuntimeError, match="brought nan values into weight's"):
                layer.backward_dw()
        for p, held in zip(layer.parameters(), before):
            torch.testing.assert_close(p.main_grad if fused else p.grad, held, rtol=0, atol=0, equal_nan=True)

        # -inf in bias[0] before; the gradient brings +inf there and no nan
        layer, reference = build((1, 0), -float("inf"))
        x = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.3, 0.2, 0.1, 0.4]])

        def infinite_dy(grad):
            grad = grad.clone()
            grad[0, 0] = float("inf")
            return grad

        with torch.autograd.set_detect_anomaly(True, check_nan=True):
            for module in (reference, layer):
                out = module(x)
                out.register_hook(infinite_dy)
                out.sum().backward()
            layer.backward_dw()  # no error, as autograd's
        for p, q in zip(layer.parameters(), reference.parameters()):
            torch.testing.assert_close(p.main_grad if fused else p.grad, q.grad, equal_nan=True)
        assert layer.bias.main_grad[0].isnan() if fused else layer.bias.grad[0].isnan()


def test_anomaly_nan_in_one_gemm_drops_the_rest_of_its_pass():
    """A LayerNormMLP whose fc2 gradient brings a nan: autograd's backward stops there, so the
    pass's fc1 item is dropped with it (named in the error), nothing stays pending, and the next
    step's backward_dw() runs that step, with autograd's gradients and one hook call."""
    module = splitgrad.LayerNormMLP(8, 6, activation="relu", delay_wgrad_compute=True, device="cpu", name="mlp")
    fired = []
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(1))
    with torch.no_grad():
        module.fc1_bias[2] = float("inf")  # relu(inf) = inf: fc2's wgrad alone sees inf * 0 = nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True, check_nan=True):
            module(torch.randn(5, 8)).nan_to_num(0.0).sum().backward()
            with pytest.raises(RuntimeError, match=r"\(fc2\): backward_dw\(\) .*brought nan values.* \(fc1\) were dropped"):
                module.backward_dw()
    assert splitgrad.pending_wgrads() == 0 and not fired
    assert all(p.grad is None for p in (module.fc1_weight, module.fc2_weight))
    with torch.no_grad():
        module.fc1_bias[2] = 0.0
    module.zero_grad(set_to_none=True)
    for _ in range(2):
        fired.clear()
        reference = to_reference(module)
        x = torch.randn(5, 8)
        module(x).sum().backward()
        module.backward_dw()
        reference(x).sum().backward()
        assert splitgrad.pending_wgrads() == 0 and len(fired) == 1
        for (name, p), q in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        module.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _conversion_mode(flag: str):
    """torch.__future__'s overwrite_module_params_on_conversion or swap_module_params_on_conversion."""
    getter, setter = (getattr(torch.__future__, f"{verb}_{flag}_module_params_on_conversion") for verb in ("get", "set"))
    before = getter()
    setter(True)
    try:
        yield
    finally:
        setter(before)


def _forward(kind, module, x):
    return module(x, [1, 2, 2]) if kind == "GroupedLinear" else module(x)


@pytest.mark.parametrize("mode", ["in place", "overwrite", "swap"])
@pytest.mark.parametrize("conversion", ["double", "float", "meta"])
@pytest.mark.parametrize("kind", MODULES)
def test_a_conversion_runs_the_pending_work_of_the_parameters_first(kind, conversion, mode):
    """PyTorch converts each parameter's .grad with it, in place or into a new Parameter object
    (set_overwrite_module_params_on_conversion, a device change such as .to("meta"), swap mode):
    the deferred work owed to the parameters runs first, so that the converted .grad is plain
    autograd's; the module's reduce hooks fire once for each parameter."""
    module = _build(kind, delay_wgrad_compute=True, device="cpu")
    reference = to_reference(module)
    fired = []
    if mode != "swap":  # (swap mode refuses a parameter with hooks: PyTorch's weak references)
        module.register_wgrad_accumulation_and_reduce_hooks(lambda p: fired.append(p))
    x = torch.randn(5, 8)
    for m in (module, reference):
        out = _forward(kind, m, x)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    params = list(module.parameters()) if mode != "swap" else []
    convert = (lambda m: m.to("meta")) if conversion == "meta" else (lambda m: getattr(m, conversion)())
    with contextlib.ExitStack() as stack:
        if mode != "in place":
            stack.enter_context(_conversion_mode(mode))
        convert(module)
        convert(reference)
    assert splitgrad.pending_wgrads() == 0
    assert sorted(map(id, fired)) == sorted(map(id, params)), "each hook once, before the conversion"
    for (name, got), want in zip(module.named_parameters(), reference.parameters()):
        assert got.dtype == want.dtype and got.device == want.device and got.grad.device == want.grad.device
        if conversion != "meta":
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", MODULES)
def test_swap_mode_with_reduce_hooks_is_refused_before_anything_converts(kind):
    """PyTorch cannot swap a tensor with weak references (a reduce hook's): a typed error before
    any parameter of the module converts, not PyTorch's error half-way (a norm's parameters done)."""
    module = _build(kind, device="cpu", name="blocks.0.fc")
    module.register_wgrad_accumulation_and_reduce_hooks(lambda p: None)
    with _conversion_mode("swap"):
        with pytest.raises(splitgrad.ArgumentError, match=r"'blocks.0.fc'.*cannot swap parameters that have reduce hooks"):
            module.double()
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_a_tied_parameter_converted_in_one_module_keeps_the_whole_gradient_in_both():
    """Two delayed layers share a weight; converting one of them (overwrite mode: a new Parameter
    for that module only) leaves both the unconverted original and the converted copy with the
    complete gradient, as plain autograd's .grad was copied."""
    a = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True)
    b = splitgrad.Linear(8, 8, device="cpu", delay_wgrad_compute=True)
    b.weight = a.weight
    ra, rb = nn.Linear(8, 8), nn.Linear(8, 8)
    with torch.no_grad():
        ra.weight.copy_(a.weight), ra.bias.copy_(a.bias), rb.bias.copy_(b.bias)
    rb.weight = ra.weight
    x = torch.randn(3, 8)
    b(a(x)).pow(2).sum().backward()
    rb(ra(x)).pow(2).sum().backward()
    with _conversion_mode("overwrite"):
        b.double()
        rb.double()
    assert b.weight is not a.weight
    for got, want in ((a.weight, ra.weight), (b.weight, rb.weight), (a.bias, ra.bias), (b.bias, rb.bias)):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    assert splitgrad.pending_wgrads() == 0


def test_a_regular_layer_swaps_while_another_layer_has_work_pending():
    """Swap mode needs the parameter referenced from nowhere else: a delayed layer's queued item
    keeps the values it needs only, not the upstream layers' autograd graph."""
    regular = splitgrad.Linear(4, 4, device="cpu")
    delayed = splitgrad.Linear(4, 4, device="cpu", delay_wgrad_compute=True)
    delayed(regular(torch.randn(3, 4))).sum().backward()
    with _conversion_mode("swap"):
        regular.double()
    assert regular.weight.dtype == torch.float64 and splitgrad.pending_wgrads() == 1
    delayed.backward_dw()


@pytest.mark.parametrize("kind", MODULES)
def test_device_none_honours_a_default_device_and_an_explicit_device_wins(kind):
    torch.set_default_device("meta")
    try:
        assert all(p.is_meta for p in _build(kind).parameters())
        assert all(p.device.type == "cpu" for p in _build(kind, device="cpu").parameters())
    finally:
        torch.set_default_device(None)
    with torch.device("cpu"):  # a CPU context is honoured too, as by nn.Linear (also with CUDA present)
        assert all(p.device.type == "cpu" for p in _build(kind).parameters())
    # No context, no default device: CUDA when available, else the CPU (SPEC §2)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert all(p.device.type == expected for p in _build(kind).parameters())


@pytest.mark.parametrize("kind", MODULES)
def test_need_backward_dw_as_te(kind):
    """TE's name: True for a module whose weight gradients wait for backward_dw()."""
    assert _build(kind, device="cpu", delay_wgrad_compute=True).need_backward_dw() is True
    assert _build(kind, device="cpu").need_backward_dw() is False
