"""The main job (examples/demo.py) end to end, in a short configuration: two pipeline processes over
gloo, a zero-bubble schedule next to 1F1B. It must report parity with plain autograd, print the
bubble table and write its timeline and loss-curve PNGs; and its parity check must be able to fail."""

import pathlib
import subprocess
import sys

import pytest

DEMO = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo.py"
SHORT = ["--steps", "3", "--timing-steps", "2", "--micro-batches", "4", "--batch", "2", "--context", "16",
         "--dim", "32", "--layers", "4", "--quiet"]
PNG = b"\x89PNG\r\n\x1a\n"


def run_demo(*args, timeout=300):
    done = subprocess.run([sys.executable, str(DEMO), *SHORT, *args], capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def import_examples():
    """examples/demo.py and examples/tinygpt.py as modules."""
    sys.path.insert(0, str(DEMO.parent))
    try:
        import demo
        import tinygpt
    finally:
        sys.path.remove(str(DEMO.parent))
    return demo, tinygpt


def twin_models(**shape):
    """The demo's splitgrad model and its plain-PyTorch reference on the CPU in float32, checked
    to have the same parameters under the same (TE's) names, equal at the start, and no splitgrad
    module in the reference. Returns both models and their parameters by name."""
    import torch
    from torch import nn

    demo, tinygpt = import_examples()
    ours = nn.Sequential(*tinygpt.build_pieces(demo.delayed_layers(torch.device("cpu"), torch.float32), **shape))
    plain = nn.Sequential(*tinygpt.build_pieces(tinygpt.plain_layers("cpu", torch.float32), **shape))
    assert not any(isinstance(m, demo.SPLITGRAD_MODULES) for m in plain.modules())
    ours_params = dict(ours.named_parameters())
    plain_params = tinygpt.te_named_parameters(plain)
    assert sorted(ours_params) == sorted(plain_params)
    for name, p in ours_params.items():
        assert torch.equal(p, plain_params[name]), name
    return ours, plain, ours_params, plain_params


@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_demo_reports_parity_bubbles_and_writes_the_plots(tmp_path, schedule):
    pytest.importorskip("matplotlib", reason="the demo's plots need matplotlib (installed by scripts/env.sh)")
    status, printed = run_demo("--schedule", schedule, "--out", str(tmp_path))
    assert status == 0, printed
    assert "PARITY OK" in printed
    assert "parameters after 3 steps vs plain autograd: largest difference" in printed
    assert "copies on the first and the last stage are bit-identical" in printed
    assert "bubble, measured" in printed and "1F1B |" in printed
    for name in ("demo_timeline.png", "demo_loss.png"):
        png = tmp_path / name
        assert png.exists() and png.read_bytes()[:8] == PNG, name


def test_demo_fails_when_the_tolerance_is_impossible(tmp_path):
    """With a negative tolerance no parameter difference passes, so the job must exit 1."""
    status, printed = run_demo("--steps", "1", "--compare", "", "--tolerance", "-1", "--out", str(tmp_path))
    assert status == 1, printed
    assert "PARITY FAILED" in printed


def test_demo_refuses_an_output_folder_it_cannot_create(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, printed = run_demo("--out", str(blocker / "plots"), timeout=120)
    assert status == 2, printed
    assert f"demo.py: error: --out {str(blocker / 'plots')!r}: cannot create the folder" in printed, printed


@pytest.mark.parametrize("args, expected", [
    (["--heads", "3"], "--heads 3 must divide --dim 32"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--micro-batches", "5"], "--micro-batches 5: ZB1P (zero bubble) on 2 ranks needs a multiple of its number of rounds"),
    (["--schedule", "dualpipev", "--micro-batches", "3"],
     "--micro-batches 3: DualPipeV on 2 ranks needs at least as many micro-batches as stages (4)"),
    (["--micro-batches", "1"], "--micro-batches 1: 1F1B on 2 ranks needs at least as many"),  # the --compare one
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--tolerance", "nan"], "--tolerance must be a number, got nan"),
    (["--moe", "--topk", "5"], "--topk must be between 1 and --experts 4, got 5"),
    (["--model", "big"], "argument --model: invalid choice: 'big' (choose from 'tiny', 'small', 'gpt2-medium', '1b')"),
    # a GPU size defaults to CUDA, one GPU per rank (64 are visible nowhere)
    (["--model", "1b", "--stages", "64", "--micro-batches", "64", "--compare", ""],
     "--device cuda needs 64 GPUs (one per pipeline rank)"),
])
def test_demo_refuses_bad_options_up_front(tmp_path, args, expected):
    """Options the model or the schedules cannot take: a one-line argparse error (exit 2) before any
    worker process starts, not a multi-process traceback."""
    status, printed = run_demo(*args, "--out", str(tmp_path), timeout=120)
    assert status == 2, printed
    assert f"demo.py: error: {expected}" in printed, printed
    assert "Traceback" not in printed and "splitgrad main job" not in printed, printed


@pytest.mark.parametrize("args, expected", [
    (["--model", "gpt2-medium", "--heads", "5"], "--heads 5 must divide --dim 1024"),
    (["--model", "1b", "--device", "cpu", "--context", "4000"], "--context 4000 must be at most 3158"),
    (["--model", "small", "--device", "cpu", "--stages", "32", "--micro-batches", "32", "--compare", ""],
     "zb1p on 32 ranks has 32 stages: --layers must be at least that"),
])
def test_demo_model_presets_fill_the_shape(tmp_path, args, expected):
    """--model sets the shape (gpt2-medium: dim 1024; small: 16 blocks) unless an option overrides
    it; the checks see the preset's values."""
    done = subprocess.run([sys.executable, str(DEMO), *args, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    printed = done.stdout + done.stderr
    assert done.returncode == 2, printed
    assert f"demo.py: error: {expected}" in printed, printed


def test_demo_bfloat16_trains_with_fp32_main_grad(tmp_path):
    """Below float32 the job is Megatron's mixed precision (fp32 main_grad fused in the delayed
    layers, fp32 master weights), in the pipeline and the reference alike: they agree."""
    status, printed = run_demo("--dtype", "bfloat16", "--compare", "", "--out", str(tmp_path))
    assert status == 0, printed
    assert "delayed splitgrad.LayerNormLinear (QKV), Linear and LayerNormMLP with fp32 main_grad" in printed
    assert "bfloat16" in printed
    assert "PARITY OK" in printed
    assert "copies on the first and the last stage are bit-identical" in printed


def test_demo_moe_trains_under_zero_bubble_with_parity(tmp_path):
    """--moe: each block's MLP a top-2 mixture of 4 experts on delayed splitgrad.GroupedLinear (and a
    delayed splitgrad.Linear router), trained under ZB1P on 2 processes; every parameter, experts'
    included, must match the plain per-expert F.linear model to float32's tolerance."""
    status, printed = run_demo("--moe", "--compare", "", "--out", str(tmp_path))
    assert status == 0, printed
    assert "a top-2 MoE of 4 GroupedLinear experts" in printed, printed
    assert "PARITY OK" in printed
    assert "copies on the first and the last stage are bit-identical" in printed
    difference = float(printed.split("largest difference ")[1].split(" ")[0])
    assert difference <= 1e-5, printed


def test_zero_bubble_example_script_trains_under_torchrun():
    """examples/pipeline_zero_bubble.py, as the README runs it (torchrun, 2 processes, gloo)."""
    example = DEMO.parent / "pipeline_zero_bubble.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(example)], capture_output=True, text=True, timeout=300)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    losses = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, printed


def test_data_parallel_example_trains_the_same_in_both_modes():
    """examples/data_parallel.py under torchrun (2 processes, gloo): GradReducer (DDP-style) and
    FSDP2 train the same model on the same data to the same losses, and the reductions start
    during backward_dw()."""
    example = DEMO.parent / "data_parallel.py"
    losses = {}
    for mode in ("ddp", "fsdp"):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", str(example), "--mode", mode, "--steps", "20"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
        assert len(lines) == 2, done.stdout
        losses[mode] = [float(line.split("loss ")[1].split(";")[0]) for line in lines]
        started, total = lines[-1].rsplit(": ", 1)[1].split(" of ")
        assert int(started) >= 1 and int(total) >= int(started), lines[-1]
    assert losses["ddp"][-1] < 2.0, losses
    assert abs(losses["ddp"][-1] - losses["fsdp"][-1]) < 1e-3, losses


def test_the_reference_is_plain_pytorch_with_the_same_weights():
    """The parity check's reference: the demo's model in plain PyTorch modules (nn.LayerNorm,
    nn.Linear; no splitgrad module in it), whose parameters under TE's names are exactly the
    splitgrad model's, equal at the start, computing the same function."""
    import torch
    from torch import nn

    import splitgrad

    ours, plain, ours_params, _ = twin_models(vocab=40, dim=32, heads=4, layers=2, context=16, seed=3)
    kinds = {type(m) for m in ours.modules()}
    assert {splitgrad.LayerNormLinear, splitgrad.LayerNormMLP, splitgrad.Linear} <= kinds
    assert isinstance(ours[1].qkv, splitgrad.LayerNormLinear) and isinstance(ours[1].mlp, splitgrad.LayerNormMLP)
    assert ours[1].mlp.activation == "gelu" and ours[1].qkv.normalization == "LayerNorm"
    assert sum(isinstance(m, nn.LayerNorm) for m in plain.modules()) == 2 * 2 + 1
    assert "1.qkv.layer_norm_weight" in ours_params and "2.mlp.fc2_bias" in ours_params
    ids = torch.randint(0, 40, (2, 16))
    torch.testing.assert_close(ours(ids), plain(ids), rtol=0, atol=0)
    assert splitgrad.pending_wgrads() == 0  # nothing was backpropagated


@pytest.mark.parametrize("experts", [0, 3], ids=["dense", "moe"])
def test_only_the_gemm_parameters_are_fused(experts):
    """In bf16 the GEMMs' weights and biases add into main_grad inside their W steps (--moe: the
    router's and every expert's too); the norms' parameters (layer_norm_weight / layer_norm_bias,
    as in TE; the MoE block's nn.LayerNorm) and the embeddings go through .grad and the hook."""
    import torch
    from torch import nn

    demo, tinygpt = import_examples()
    shape = dict(vocab=40, dim=32, heads=4, layers=1, context=16, seed=0, experts=experts)
    model = nn.Sequential(*tinygpt.build_pieces(demo.delayed_layers(torch.device("cpu"), torch.bfloat16), **shape,
                                                dtype=torch.bfloat16))
    fused = demo.fused_parameters(model)
    hooked = sorted(n for n, p in model.named_parameters() if id(p) not in fused)
    mlp_norm = ["1.mlp.norm.bias", "1.mlp.norm.weight"] if experts else ["1.mlp.layer_norm_bias",
                                                                          "1.mlp.layer_norm_weight"]
    assert hooked == ["0.positions", "0.tokens.weight", *mlp_norm, "1.qkv.layer_norm_bias", "1.qkv.layer_norm_weight",
                      "2.norm.bias", "2.norm.weight"]
    if experts:
        assert {id(model[1].mlp.router.weight), id(model[1].mlp.fc2.weight2), id(model[1].mlp.fc1.bias0)} <= fused


def test_the_moe_reference_is_plain_pytorch_with_the_same_weights():
    """--moe's parity reference: the same MoE blocks with per-expert F.linear experts
    (tinygpt.PlainGroupedLinear) and an nn.Linear router, with the splitgrad model's parameters and
    names, computing the same function; after one backward (and the deferred W) every gradient,
    each expert's included, is plain autograd's, bit for bit on the CPU. The experts get their
    counts as an int64 tensor (m_splits), and the routing is uneven."""
    import torch
    from torch import nn

    import splitgrad

    _, tinygpt = import_examples()
    ours, plain, ours_params, plain_params = twin_models(vocab=40, dim=32, heads=4, layers=2, context=16, seed=3,
                                                         experts=4, topk=2)
    mlp = ours[1].mlp
    assert isinstance(mlp, tinygpt.MoEMLP) and isinstance(mlp.router, splitgrad.Linear)
    assert isinstance(mlp.fc1, splitgrad.GroupedLinear) and mlp.fc1.num_gemms == 4 and mlp.fc1.delay_wgrad_compute
    assert isinstance(plain[1].mlp.fc1, tinygpt.PlainGroupedLinear) and type(plain[1].mlp.router) is nn.Linear
    assert "1.mlp.fc1.weight3" in ours_params and "2.mlp.fc2.bias0" in ours_params

    splits = []
    mlp.fc1.register_forward_pre_hook(lambda module, args: splits.append(args[1]))
    ids = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = ours(ids)
    torch.testing.assert_close(logits, plain(ids), rtol=0, atol=0)
    (m_splits,) = splits
    assert isinstance(m_splits, torch.Tensor) and m_splits.dtype == torch.int64
    assert m_splits.sum().item() == 2 * 16 * 2 and len(set(m_splits.tolist())) > 1, m_splits

    tinygpt.lm_loss(logits, targets).backward()
    assert splitgrad.pending_wgrads() > 0  # the experts' and the router's W is deferred
    splitgrad.backward_dw_all()
    tinygpt.lm_loss(plain(ids), targets).backward()
    for name, p in ours_params.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, plain_params[name].grad, rtol=0, atol=0, msg=name)
