"""splitgrad.Linear in ordinary PyTorch workflows (issue 18): parametrizations, autocast,
autograd.grad, frozen weights, double backward, torch.export, hooks and garbage collection, names.
Each case runs the same computation with plain nn.Linear autograd and compares."""

import contextlib
import copy
import gc
import io
import re
import subprocess
import sys
import textwrap
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize, prune

import splitgrad
from sg_helpers import assert_grads_match, backward_under_compiled_autograd, to_reference

D = 6
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def layer(delay: bool, bias: bool = True, **kwargs) -> splitgrad.Linear:
    return splitgrad.Linear(D, D, bias=bias, device=kwargs.pop("device", "cpu"), delay_wgrad_compute=delay, **kwargs)


def plain_twin(module: splitgrad.Linear) -> nn.Linear:
    twin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                     device=module.weight.device, dtype=module.weight.dtype)
    with torch.no_grad():
        twin.weight.copy_(module.weight)
        if module.bias is not None:
            twin.bias.copy_(module.bias)
    return twin


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# 1. Non-leaf weights --------------------------------------------------------------------------


class Double(nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("how", ["parametrize", "weight_norm", "functional_call"])
def test_non_leaf_weight_gets_its_gradient_to_the_originals(delay, how):
    """A computed weight's gradient flows on to the tensors it came from, computed at once."""
    model = layer(delay)
    ref = plain_twin(model)
    x = torch.randn(3, D)
    if how == "parametrize":
        for m in (model, ref):
            parametrize.register_parametrization(m, "weight", Double())
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        leaves = [(model.parametrizations.weight.original, ref.parametrizations.weight.original)]
    elif how == "weight_norm":
        model = nn.utils.parametrizations.weight_norm(model)
        ref = nn.utils.parametrizations.weight_norm(ref)
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        leaves = [(model.parametrizations.weight.original0, ref.parametrizations.weight.original0),
                  (model.parametrizations.weight.original1, ref.parametrizations.weight.original1)]
    else:
        w0 = model.weight.detach().clone().requires_grad_()
        a, b = torch.randn(D, 2, requires_grad=True), torch.randn(2, D, requires_grad=True)
        w0r, ar, br = (t.detach().clone().requires_grad_() for t in (w0, a, b))
        torch.func.functional_call(model, {"weight": w0 + a @ b}, (x,)).pow(2).sum().backward()
        torch.func.functional_call(ref, {"weight": w0r + ar @ br}, (x,)).pow(2).sum().backward()
        leaves = [(w0, w0r), (a, ar), (b, br)]
    assert splitgrad.pending_wgrads() == (1 if delay else 0)  # the bias (a parameter) is deferred
    if delay:
        model.backward_dw()
    for mine, theirs in leaves:
        assert mine.grad is not None
        exact(mine.grad, theirs.grad)
    exact(model.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("how", ["prune", "parametrize"])
def test_a_fused_computed_weight_is_refused_saying_why(how):
    """fuse_wgrad_accumulation needs the weight's main_grad; a pruned or parametrized weight is
    computed, and a main_grad on the leaf behind it does not help: the error says so (not "it is
    not set"), before anything runs."""
    model = splitgrad.Linear(D, D, device="cpu", fuse_wgrad_accumulation=True, name="proj")
    if how == "prune":
        prune.l1_unstructured(model, "weight", 0.3)
    else:
        parametrize.register_parametrization(model, "weight", Double())
    for p in model.parameters():  # every leaf has one, the leaf behind the weight included
        p.main_grad = torch.zeros_like(p)
    with pytest.raises(splitgrad.MainGradError, match=r"'proj'.*needs weight.main_grad, but weight is computed"):
        model(torch.randn(3, D))
    assert splitgrad.pending_wgrads() == 0


# 2. Autocast ----------------------------------------------------------------------------------


def _close_in_low_precision(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)


def _autocast_case(device, delay, fused):
    """As nn.Linear under autocast. On the CPU splitgrad runs ATen's GEMMs: the regular path is
    bit-identical; delayed and fused add in fp32 without rounding the product to the low dtype
    first. On CUDA cuBLASLt's kernels differ from torch's in rounding: close in the low dtype."""
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    same = exact if device == "cpu" else _close_in_low_precision
    model = layer(delay, device=device, fuse_wgrad_accumulation=fused)
    ref = plain_twin(model)
    if fused:
        model.weight.main_grad = torch.zeros_like(model.weight)
        model.bias.main_grad = torch.zeros_like(model.bias)
    x = torch.randn(2, 4, D, device=device, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast(device, dtype=dtype):
        y = model(x)
        yr = ref(xr)
    assert y.dtype == yr.dtype == dtype
    same(y, yr)
    gy = torch.randn_like(yr)
    y.backward(gy)
    yr.backward(gy)
    if delay:
        model.backward_dw()
    same(x.grad, xr.grad)
    assert x.grad.dtype == torch.float32
    grads = [model.weight.main_grad, model.bias.main_grad] if fused else [model.weight.grad, model.bias.grad]
    for mine, theirs in zip(grads, (ref.weight.grad, ref.bias.grad)):
        assert mine.dtype == torch.float32
        (_close_in_low_precision if delay or fused else same)(mine, theirs)


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_autocast_cpu_matches_nn_linear(delay, fused):
    _autocast_case("cpu", delay, fused)


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_autocast_takes_a_low_precision_activation(delay):
    """A bf16 activation into an fp32 layer under autocast (refused before): as nn.Linear."""
    model = layer(delay)
    ref = plain_twin(model)
    x = torch.randn(3, D, dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = model(x), ref(xr)
        exact(torch.ops.splitgrad.linear_fprop(x, model.weight, model.bias), yr)
    exact(y, yr)
    y.float().sum().backward()
    yr.float().sum().backward()
    if delay:
        model.backward_dw()
    exact(x.grad, xr.grad)
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=1e-2, atol=1e-2)


@CUDA
@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_autocast_cuda_matches_nn_linear(delay, fused):
    _autocast_case("cuda", delay, fused)


# 3. torch.autograd.grad -----------------------------------------------------------------------


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_gradient_penalty_matches_plain(delay):
    """autograd.grad(loss, x, create_graph=True) queues nothing and its x-gradient is
    differentiable; (loss + penalty).backward() then gives plain autograd's gradients (to float
    rounding: a delayed layer adds the loss's part after the penalty's)."""
    model = nn.Sequential(layer(delay), nn.Tanh(), layer(delay))
    ref = to_reference(model)
    for m in (model, ref):
        x = torch.randn(4, D, requires_grad=True, generator=torch.Generator().manual_seed(1))
        loss = m(x).pow(2).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        if m is model:
            assert splitgrad.pending_wgrads() == 0
        (loss + gx.pow(2).sum()).backward()
        if m is model and delay:
            splitgrad.backward_dw_all()
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_autograd_grad_of_weight_and_bias_returns_them(delay):
    model = layer(delay)
    ref = plain_twin(model)
    x = torch.randn(3, D)
    gw, gb = torch.autograd.grad(model(x).pow(2).sum(), [model.weight, model.bias])
    rw, rb = torch.autograd.grad(ref(x).pow(2).sum(), [ref.weight, ref.bias])
    exact(gw, rw)
    exact(gb, rb)
    assert splitgrad.pending_wgrads() == 0
    assert model.weight.grad is None and model.bias.grad is None


def test_input_only_pass_queues_nothing():
    """backward(inputs=[x]) writes no parameter's .grad in plain autograd: nothing is queued."""
    model = layer(True)
    x = torch.randn(3, D, requires_grad=True)
    model(x).sum().backward(inputs=[x])
    assert splitgrad.pending_wgrads() == 0
    assert model.weight.grad is None


# 4. Grad-ready hooks only for passes that write gradients -------------------------------------


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_grad_ready_hooks_ignore_autograd_grad(delay):
    model = nn.Sequential(layer(delay), nn.Linear(D, D))
    fired = []
    for p in model.parameters():
        splitgrad.register_grad_ready_hook(p, lambda p: fired.append(p.grad is not None))
    x = torch.randn(3, D)
    torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert fired == []
    model(x).sum().backward()
    splitgrad.backward_dw_all()
    assert fired == [True] * 4


def test_grad_reducer_step_after_autograd_grad(tmp_path):
    """A GradReducer step preceded by autograd.grad over the same parameters is plain's."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(layer(True), nn.Tanh(), nn.Linear(D, D))
        ref = to_reference(model)
        reducer = splitgrad.distributed.GradReducer(model)
        x = torch.randn(3, D)
        torch.autograd.grad(model(x).sum(), list(model.parameters()))
        model(x).sum().backward()
        model[0].backward_dw()
        reducer.finish()
        ref(x).sum().backward()
        for mine, theirs in zip(model.parameters(), ref.parameters()):
            exact(mine.grad, theirs.grad)
    finally:
        dist.destroy_process_group()


# 5. requires_grad is decided at the forward ---------------------------------------------------


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_weight_frozen_at_forward_gets_no_gradient(delay):
    model = layer(delay)
    ref = plain_twin(model)
    x = torch.randn(3, D)
    outs = []
    for m in (model, ref):
        m.weight.requires_grad_(False)
        outs.append(m(x).sum())
        m.weight.requires_grad_(True)
    for out in outs:
        out.backward()
    if delay:
        model.backward_dw()
    assert model.weight.grad is None and ref.weight.grad is None
    exact(model.bias.grad, ref.bias.grad)


# 6. Double backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_double_backward_matches_plain(delay):
    model = nn.Sequential(layer(delay), nn.Tanh(), layer(delay))
    ref = to_reference(model)
    x = torch.randn(4, D)
    results = []
    for m in (model, ref):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m(x).pow(2).sum().backward(create_graph=True)
        assert not [w for w in caught if "autograd kernel" in str(w.message)]
        assert splitgrad.pending_wgrads() == 0
        grads = [p.grad for p in m.parameters()]
        assert all(g.requires_grad for g in grads)
        penalty = sum(g.pow(2).sum() for g in grads)
        second = torch.autograd.grad(penalty, list(m.parameters()))
        results.append((grads, second))
    (g_mine, s_mine), (g_ref, s_ref) = results
    for a, b in zip(g_mine + list(s_mine), g_ref + list(s_ref)):
        torch.testing.assert_close(a, b)


def test_double_backward_with_main_grad_is_refused():
    model = layer(True, fuse_wgrad_accumulation=True)
    model.weight.main_grad = torch.zeros_like(model.weight)
    model.bias.main_grad = torch.zeros_like(model.bias)
    with pytest.raises(RuntimeError, match=r"splitgrad layer '.*': fuse_wgrad_accumulation=True cannot .*create_graph"):
        model(torch.randn(3, D)).sum().backward(create_graph=True)


@pytest.mark.parametrize("module", ["Linear", "GroupedLinear", "LayerNormMLP"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
def test_fused_gradient_penalty_is_refused_when_it_reaches_the_weight(module, delay):
    """A gradient penalty's part of the weight gradient flows through the create_graph=True input
    gradient (dx = dy·W): it would land in .grad beside main_grad (and Megatron drops a .grad once
    grad_added_to_main_grad is set), so it is refused when it reaches the weight. A second order
    in the inputs alone (a Hessian-vector product in x) never reaches the weight: it runs and
    equals plain autograd's."""
    kw = dict(device="cpu", delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
    model = {"Linear": lambda: splitgrad.Linear(D, D, **kw),
             "GroupedLinear": lambda: splitgrad.GroupedLinear(2, D, D, **kw),
             "LayerNormMLP": lambda: splitgrad.LayerNormMLP(D, 2 * D, **kw)}[module]()
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape)
    run = (lambda x: model(x, [1, 2])) if module == "GroupedLinear" else model
    x = torch.randn(3, D, requires_grad=True, generator=torch.Generator().manual_seed(2))
    loss = run(x).pow(2).sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    assert splitgrad.pending_wgrads() == 0
    with pytest.raises(RuntimeError, match=r"splitgrad layer '[^']*'( \(fc\d\))?: a gradient reached the weight through the "
                                           r"input gradient of a backward with create_graph=True"):
        (loss + gx.pow(2).sum()).backward()
    splitgrad.backward_dw_all()  # what the refused pass queued before the error, if anything

    # Hessian-vector product in x: the weights are not differentiated. Reference: the same module
    # without fusing, the same weights.
    v = torch.randn(3, D, generator=torch.Generator().manual_seed(3))
    plain = {"Linear": lambda: splitgrad.Linear(D, D, device="cpu"),
             "GroupedLinear": lambda: splitgrad.GroupedLinear(2, D, D, device="cpu"),
             "LayerNormMLP": lambda: splitgrad.LayerNormMLP(D, 2 * D, device="cpu")}[module]()
    plain.load_state_dict(model.state_dict())
    hvps = []
    for m in (model, plain):
        for p in m.parameters():
            p.requires_grad_(False)
        xm = x.detach().requires_grad_()
        out = m(xm, [1, 2]) if module == "GroupedLinear" else m(xm)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), xm, create_graph=True)
        hvps.append(torch.autograd.grad(gx, xm, v)[0])
    assert splitgrad.pending_wgrads() == 0
    torch.testing.assert_close(hvps[0], hvps[1], rtol=0, atol=0)


# 7. torch.export ------------------------------------------------------------------------------


def _export_roundtrip(device, tmp_path):
    model = nn.Sequential(layer(True, device=device), nn.ReLU(), layer(False, device=device))
    x = torch.randn(3, D, device=device)
    program = torch.export.export(model, (x,))
    assert all(node.args[5:] == (0, False) for node in program.graph.nodes
               if node.op == "call_function" and "splitgrad.linear" in str(node.target))
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    torch.save({"x": x.cpu(), "y": model(x).detach().cpu()}, tmp_path / "io.pt")
    splitgrad.backward_dw_all()  # nothing should be pending: the forward above had no backward
    # A fresh process, with other layers registered first (their ids must not matter).
    script = textwrap.dedent(f"""
        import torch, splitgrad
        others = [splitgrad.Linear(2, 2, device="cpu", delay_wgrad_compute=True) for _ in range(3)]
        program = torch.export.load({str(path)!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        x = io["x"].to({device!r})
        with torch.no_grad():
            y = program.module()(x)
        torch.testing.assert_close(y.cpu(), io["y"], rtol=0, atol=0)
        y = program.module()(x.requires_grad_())
        y.sum().backward()
        assert splitgrad.pending_wgrads() == 0
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_export_does_not_depend_on_the_process_registry(tmp_path):
    _export_roundtrip("cpu", tmp_path)


@CUDA
def test_export_does_not_depend_on_the_process_registry_cuda(tmp_path):
    _export_roundtrip("cuda", tmp_path)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_records_a_regular_unregistered_call():
    model = layer(True)
    ref = plain_twin(model)
    x = torch.randn(3, D)
    traced = torch.jit.trace(model, (x,))
    calls = [n for n in traced.inlined_graph.nodes() if n.kind() == "splitgrad::linear"]
    assert len(calls) == 1 and [i.toIValue() for i in list(calls[0].inputs())[5:]] == [0, False, None, False, None]
    traced(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert splitgrad.pending_wgrads() == 0
    exact(model.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fused_layer_accumulates_into_main_grad(backend):
    """A fused layer under torch.compile runs eagerly (a graph break): its gradient reaches main_grad,
    not the .grad a compiled backward would give it."""
    torch._dynamo.reset()
    model = layer(False, fuse_wgrad_accumulation=True)
    model.weight.main_grad = torch.zeros(D, D)
    model.bias.main_grad = torch.zeros(D)
    ref = plain_twin(model)
    compiled = torch.compile(nn.Sequential(model, nn.GELU()), backend=backend)
    x = torch.randn(5, D)
    compiled(x).pow(2).sum().backward()
    torch.nn.functional.gelu(ref(x)).pow(2).sum().backward()
    assert model.weight.grad is None and model.bias.grad is None
    torch.testing.assert_close(model.weight.main_grad, ref.weight.grad)
    torch.testing.assert_close(model.bias.main_grad, ref.bias.grad)


def test_fullgraph_compile_of_a_delayed_layer_says_why():
    torch._dynamo.reset()
    model = layer(True)
    with pytest.raises(Exception, match="runs eagerly"):
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(3, D))


def test_export_of_a_fused_layer_records_an_unfused_call():
    model = layer(False, fuse_wgrad_accumulation=True)
    model.weight.main_grad = torch.zeros(D, D)
    x = torch.randn(3, D)
    program = torch.export.export(model, (x,))
    exact(program.module()(x), model(x).detach())


# 8. Deleted models are freed ------------------------------------------------------------------


def _is_freed(make) -> bool:
    ref = make()
    gc.collect()
    return ref() is None


def test_models_with_hooks_are_freed():
    def make():
        model = nn.Sequential(layer(True), nn.Linear(D, D))
        for p in model.parameters():
            splitgrad.register_grad_ready_hook(p, lambda p, model=model: model.training)
        model[0].register_wgrad_accumulation_and_reduce_hooks(lambda: model.training)
        model(torch.randn(2, D)).sum().backward()
        model[0].backward_dw()
        return weakref.ref(model)

    assert all(_is_freed(make) for _ in range(3))


def test_models_with_a_grad_reducer_are_freed(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        def make():
            model = nn.Sequential(layer(True), nn.Linear(D, D))
            reducer = splitgrad.distributed.GradReducer(model)
            model(torch.randn(2, D)).sum().backward()
            model[0].backward_dw()
            reducer.finish()
            model.reducer = reducer
            return weakref.ref(model)

        assert all(_is_freed(make) for _ in range(3))
    finally:
        dist.destroy_process_group()


def test_models_dropped_with_pending_work_are_freed(tmp_path):
    # The queue holds its parameters weakly: a hook or GradReducer referring to the model does not
    # keep it alive through the queued item; its work is dropped with a warning naming the layer.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        def make(with_reducer):
            model = nn.Sequential(layer(True, name="dropped_fc"), nn.Linear(D, D))
            if with_reducer:
                model.reducer = splitgrad.distributed.GradReducer(model)
            for p in model.parameters():
                splitgrad.register_grad_ready_hook(p, lambda p, model=model: model.training)
            model(torch.randn(2, D)).sum().backward()
            assert splitgrad.pending_wgrads() == 1
            return weakref.ref(model)

        for with_reducer in (False, True, False):
            with pytest.warns(splitgrad.PendingWgradWarning, match="'dropped_fc' was deleted with 1 deferred"):
                assert _is_freed(lambda: make(with_reducer))
            assert splitgrad.pending_wgrads() == 0
    finally:
        dist.destroy_process_group()


def test_pending_work_of_a_freed_tied_parameter_is_skipped():
    # Layer b uses a's weight; a (the owner) and the weight are freed before b's work runs: b's
    # work still lands on b's bias, and the freed weight needs no gradient.
    a, b = layer(True), layer(True)
    b.weight = a.weight
    b(torch.randn(2, D)).sum().backward()
    del a
    b.weight = nn.Parameter(torch.zeros(D, D))
    gc.collect()
    b.backward_dw()
    assert b.weight.grad is None
    torch.testing.assert_close(b.bias.grad, torch.full((D,), 2.0), rtol=0, atol=0)


def test_work_for_a_freed_parameter_is_reported_and_taken_by_any_call():
    # A gather/release pattern: the parameter the work was for is gone when the W step runs. The
    # contribution cannot land: it is reported, and the per-model call takes the orphaned item
    # (its stash freed) instead of leaving it queued until the layer goes.
    model = nn.Sequential(layer(True, bias=False, name="gathered"))
    for _ in range(3):
        model[0].weight = nn.Parameter(torch.randn(D, D))
        model(torch.randn(2, D)).sum().backward()
        model[0].weight = nn.Parameter(torch.zeros(D, D))  # the gathered one is released
        gc.collect()
        with pytest.warns(UserWarning, match="'gathered': the weight parameter .* was freed"):
            splitgrad.backward_dw_all(model.parameters())
        assert splitgrad.pending_wgrads() == 0
        assert model[0].weight.grad is None


@pytest.mark.parametrize("kind", ["LayerNormMLP", "GroupedLinear"])
def test_the_freed_parameter_warning_names_the_gemm_and_the_expert(kind):
    # Parameters replaced with work pending (load_state_dict(assign=True)): each dropped
    # contribution is reported with the parameter as the module names it, a LayerNormMLP's
    # GEMM (fc1 / fc2) and a GroupedLinear's expert (weight0, bias1, ...).
    build, _, more_args = COMPUTED_WEIGHT[kind]
    model = build(device="cpu", delay_wgrad_compute=True, name="m")
    model(torch.randn(5, D), *more_args).sum().backward()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, assign=True)
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.backward_dw()
    named = sorted(re.search(r"'m'( \(fc\d\))?: the (\w+) parameter .* was freed", str(w.message)).group(1, 2)
                   for w in caught)
    want = ([(" (fc1)", "bias"), (" (fc1)", "weight"), (" (fc2)", "bias"), (" (fc2)", "weight")]
            if kind == "LayerNormMLP" else sorted((None, f"{p}{i}") for p in ("weight", "bias") for i in range(3)))
    assert named == want
    assert splitgrad.pending_wgrads() == 0
    assert all(p.grad is None for p in model.parameters())


def test_hook_handles_remove_and_copies_carry_no_hooks():
    model = layer(False)
    fired = []
    handle = splitgrad.register_grad_ready_hook(model.weight, lambda p: fired.append(1))
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    model(torch.randn(2, D)).sum().backward()
    clone(torch.randn(2, D)).sum().backward()
    assert fired == [1]
    assert handle.active
    handle.remove()
    assert not handle.active
    model(torch.randn(2, D)).sum().backward()
    assert fired == [1]


# 9. Names -------------------------------------------------------------------------------------


def test_copies_get_their_own_default_name():
    model = layer(True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    names = [model.name] + [c.name for c in copies]
    assert len(set(names)) == 3, names
    assert all(n == f"Linear({D}, {D})#{m._layer_id}" for n, m in zip(names, [model] + copies))
    named = layer(True, name="fc")
    assert copy.deepcopy(named).name == "fc"  # a chosen name is kept


def test_layer_deleted_before_backward_still_delivers_its_gradients():
    """As nn.Linear's: a delayed layer gone before its backward adds its gradients at once to the
    parameters that outlive it (nothing could run deferred work later), without a warning."""
    model = layer(True, name="fc")
    weight, bias = model.weight, model.bias
    x = torch.randn(2, D)
    y = model(x).sum()
    del model
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y.backward()
    assert splitgrad.pending_wgrads() == 0
    torch.testing.assert_close(weight.grad, torch.ones(2, D).t() @ x, rtol=0, atol=0)
    torch.testing.assert_close(bias.grad, torch.full((D,), 2.0), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_messages_name_the_layer_and_dtypes_as_torch_does():
    model = layer(False, name="fc")
    with pytest.raises(TypeError, match=r"^splitgrad layer 'fc': expected a torch.Tensor input"):
        model([1.0] * D)
    with pytest.raises(TypeError, match=r"torch\.int64"):
        model(torch.ones(2, D, dtype=torch.long))
    with pytest.raises(TypeError, match=r"splitgrad layer 'fc' cannot be compiled by torch.jit.script"):
        torch.jit.script(nn.Sequential(model))


# 10. Dynamic shapes ---------------------------------------------------------------------------


def test_export_with_dynamic_dims_runs_at_other_sizes():
    model = nn.Sequential(layer(True), nn.ReLU(), layer(False))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.export.export(model, (torch.randn(3, 5, D),),
                                  dynamic_shapes=({0: batch, 1: seq},))
    exported = program.module()
    for shape in [(2, 7, D), (4, 2, D), (3, 5, D)]:
        x = torch.randn(shape)
        twins = [plain_twin(model[0]), plain_twin(model[2])]
        y = exported(x)
        y_ref = twins[1](torch.relu(twins[0](x)))
        exact(y, y_ref)
        y.pow(2).sum().backward()
        y_ref.pow(2).sum().backward()
        params = dict(exported.named_parameters())
        exact(params["0.weight"].grad, twins[0].weight.grad)
        exact(params["2.bias"].grad, twins[1].bias.grad)
        exported.zero_grad()
    assert splitgrad.pending_wgrads() == 0


def test_compile_dynamic_traces_once_for_all_sizes():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    model = nn.Sequential(layer(False), nn.GELU(), layer(False))
    twins = nn.Sequential(plain_twin(model[0]), nn.GELU(), plain_twin(model[2]))
    compiled = torch.compile(model, dynamic=True, backend="aot_eager")
    for tokens in (3, 5, 9, 17):
        x = torch.randn(tokens, D)
        compiled(x).pow(2).sum().backward()
        twins(x).pow(2).sum().backward()
        for mine, ref in zip(model.parameters(), twins.parameters()):
            torch.testing.assert_close(mine.grad, ref.grad)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("delay,fused", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["regular", "delayed", "fused", "delayed-fused"])
@pytest.mark.parametrize("how", ["config", "context"])
def test_compiled_autograd_matches_nn_linear(delay, fused, how):
    """Compiled autograd (dynamo's compiled_autograd flag with a compiled step, or the context
    manager) runs the C++ backward; the gradients are nn.Linear's (in main_grad where fused)."""
    model = nn.Sequential(layer(delay, fuse_wgrad_accumulation=fused), nn.GELU(),
                          layer(delay, fuse_wgrad_accumulation=fused))
    if fused:
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
    twins = nn.Sequential(plain_twin(model[0]), nn.GELU(), plain_twin(model[2]))
    x = torch.randn(5, D)
    backward_under_compiled_autograd(how, lambda: model(x).pow(2).sum().backward())
    if delay:
        splitgrad.backward_dw_all()
    twins(x).pow(2).sum().backward()
    for mine, ref in zip(model.parameters(), twins.parameters()):
        torch.testing.assert_close(mine.main_grad if fused else mine.grad, ref.grad)


# 11. torch.func transforms and forward-mode AD ------------------------------------------------


@pytest.mark.parametrize("delay,fused", [(False, False), (True, False), (True, True)])
def test_torch_func_transforms_match_nn_linear(delay, fused):
    from torch.func import functional_call, grad, jacrev, jvp, vmap

    model = layer(delay, fuse_wgrad_accumulation=fused)
    if fused:
        model.weight.main_grad = torch.zeros(D, D)
        model.bias.main_grad = torch.zeros(D)
    twin = plain_twin(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, D)

    def loss(module):
        return lambda p, x: functional_call(module, p, (x,)).pow(2).sum()

    exact(grad(loss(model))(params, x), grad(loss(twin))(params, x))
    per_sample = vmap(grad(loss(model)), in_dims=(None, 0))(params, x.unsqueeze(1))
    exact(per_sample, vmap(grad(loss(twin)), in_dims=(None, 0))(params, x.unsqueeze(1)))
    exact(jacrev(model)(x[0]), jacrev(twin)(x[0]))
    tangent = torch.randn_like(x)
    exact(jvp(model, (x,), (tangent,)), jvp(twin, (x,), (tangent,)))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, tangent)
        exact(torch.autograd.forward_ad.unpack_dual(model(dual)).tangent,
              torch.autograd.forward_ad.unpack_dual(twin(dual)).tangent)
    # Functional gradients are returned, never written: nothing queued, .grad and main_grad untouched.
    assert splitgrad.pending_wgrads() == 0
    assert model.weight.grad is None and model.bias.grad is None
    if fused:
        assert not model.weight.main_grad.any() and not model.bias.main_grad.any()


# A computed weight the layer reads (not a registered parameter of it): the module, that weight's
# name, and the forward's arguments after the input.
COMPUTED_WEIGHT = {
    "Linear": (lambda **kw: splitgrad.Linear(D, D, **kw), "weight", ()),
    "LayerNormLinear": (lambda **kw: splitgrad.LayerNormLinear(D, D, **kw), "weight", ()),
    "LayerNormMLP": (lambda **kw: splitgrad.LayerNormMLP(D, 2 * D, **kw), "fc2_weight", ()),
    "GroupedLinear": (lambda **kw: splitgrad.GroupedLinear(3, D, D, **kw), "weight1", ([2, 0, 3],)),
}


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("kind", list(COMPUTED_WEIGHT))
@pytest.mark.parametrize("how", ["parametrize", "attribute"])
def test_forward_ad_with_a_tangent_on_a_computed_weight_only(kind, how, delay):
    """Forward-mode AD whose only tangent is on a weight the layer computes (a parametrization's
    original) or is given as a plain tensor: the layer's tangent is plain autograd's (the op's C++
    autograd has no forward AD: the layer takes the ATen composite, as for a tangent on a
    parameter), and nothing is queued."""
    build, name, more_args = COMPUTED_WEIGHT[kind]
    model = build(params_dtype=torch.float64, device="cpu", delay_wgrad_compute=delay)
    reference = to_reference(model)
    x = torch.randn(5, D, dtype=torch.float64)
    tangent = torch.randn_like(getattr(model, name))
    fwAD = torch.autograd.forward_ad
    tangents = []
    for module in (model, reference):
        with fwAD.dual_level():
            if how == "parametrize":
                parametrize.register_parametrization(module, name, Double())
                original = getattr(module.parametrizations, name).original
                dual = {f"parametrizations.{name}.original": fwAD.make_dual(original.detach(), tangent)}
                out = torch.func.functional_call(module, dual, (x, *more_args))
            else:
                value = getattr(module, name).detach()
                delattr(module, name)
                setattr(module, name, fwAD.make_dual(value, tangent))
                out = module(x, *more_args)
            tangents.append(fwAD.unpack_dual(out).tangent)
    assert tangents[0] is not None
    torch.testing.assert_close(tangents[0], tangents[1])
    assert splitgrad.pending_wgrads() == 0


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("around", ["backward_dw", "backward"])
@pytest.mark.parametrize("kind", list(COMPUTED_WEIGHT))
def test_autocast_around_the_backward_or_backward_dw_only(kind, around, delay, fused):
    """torch.autocast around backward_dw() only (a W step overlapped with the next micro-batch's
    forward), or around the backward only (which PyTorch does not recommend, but runs): every
    gradient is plain autograd's bit for bit. The deferred GEMM runs under the autocast state of
    the backward that queued it, not backward_dw()'s; a dgrad the backward computed in autocast's
    dtype reaches the input activation's backward in the forward's dtype, as the engine casts a
    gradient between two nodes."""
    build, _, more_args = COMPUTED_WEIGHT[kind]
    model = build(device="cpu", delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    if fused:
        for name, param in model.named_parameters():
            if not name.startswith("layer_norm"):  # the norm's gradients go to .grad, as in TE
                param.main_grad = torch.zeros_like(param)
    reference = to_reference(model)
    x = torch.randn(5, D)

    def autocast_if(where):
        return torch.autocast("cpu", dtype=torch.bfloat16) if around == where else contextlib.nullcontext()

    for module in (model, reference):
        out = module(x, *more_args)
        with autocast_if("backward"):
            out.pow(2).sum().backward()
    with autocast_if("backward_dw"):
        model.backward_dw()
    assert splitgrad.pending_wgrads() == 0
    assert_grads_match(model, reference, exact=True)


@pytest.mark.parametrize("fused", [False, True])
def test_a_dual_level_without_tangents_changes_nothing(fused):
    # Forward-mode AD elsewhere in the step (a JVP regulariser): a layer whose tensors carry no
    # tangent defers and fuses as usual.
    model = layer(True, fuse_wgrad_accumulation=fused)
    if fused:
        model.weight.main_grad = torch.zeros(D, D)
        model.bias.main_grad = torch.zeros(D)
    twin = plain_twin(model)
    x = torch.randn(3, D)
    with torch.autograd.forward_ad.dual_level():
        model(x).pow(2).sum().backward()
    assert splitgrad.pending_wgrads() == 1
    model.backward_dw()
    twin(x).pow(2).sum().backward()
    if fused:
        torch.testing.assert_close(model.weight.main_grad, twin.weight.grad)
        assert model.weight.grad is None
    else:
        exact(model.weight.grad, twin.weight.grad)


def test_fused_layer_differentiated_at_both_levels_says_where_the_gradient_goes():
    # A physics-informed loss: u = f(x) and du = vmap(grad(f))(x), then loss(u, du).backward(). The
    # du part reaches the parameters through F.linear, i.e. .grad: a warning says so; the sum of
    # .grad and main_grad is plain autograd's.
    model = layer(False, fuse_wgrad_accumulation=True, name="pinn")
    model.weight.main_grad = torch.zeros(D, D)
    model.bias.main_grad = torch.zeros(D)
    twin = plain_twin(model)
    x = torch.randn(4, D)

    def loss(module):
        du = torch.func.vmap(torch.func.grad(lambda xi: torch.tanh(module(xi)).sum()))(x)
        return module(x).pow(2).sum() + du.pow(2).sum()

    with pytest.warns(UserWarning, match="'pinn' .* adds its gradient to weight.grad, not main_grad"):
        loss(model).backward()
    loss(twin).backward()
    torch.testing.assert_close(model.weight.main_grad + model.weight.grad, twin.weight.grad)


def test_vmap_of_the_forward_matches_nn_linear():
    model = layer(True)
    twin = plain_twin(model)
    x = torch.randn(3, 2, D)
    exact(torch.func.vmap(model)(x), torch.func.vmap(twin)(x))
    assert splitgrad.pending_wgrads() == 0


def test_torch_func_forward_checks_arguments_naming_the_layer():
    model = layer(True, name="fc")
    with pytest.raises(splitgrad.ArgumentError, match=r"splitgrad layer 'fc': expected input of shape"):
        torch.func.grad(lambda x: model(x).sum())(torch.randn(2, D + 1))
    with pytest.raises(splitgrad.DTypeError, match=r"splitgrad layer 'fc'.*torch\.float64"):
        torch.func.grad(lambda x: model(x).sum())(torch.randn(2, D, dtype=torch.float64))
