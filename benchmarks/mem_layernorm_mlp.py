"""What a LayerNormMLP training step holds at its peak, on the CPU: plain PyTorch, splitgrad's
delayed and immediate module, and two emulations of the delayed path that differ only in what fc2's
deferred wgrad keeps until ``backward_dw()``: fc2's input (the activation's output, as splitgrad
did before the activation moved into fc2's op) or fc1's output (the activation's input, which the
backward holds anyway until the activation's backward), the activation recomputed from it in
``backward_dw()`` — what splitgrad's module does now (the linear op's ``input_activation``).

Method: a TorchDispatchMode sees every ATen op of the step (forward, backward, ``backward_dw()``,
including the C++ autograd and deferred runner's ops); each storage an op creates is counted from
then until its StorageImpl dies (``weakref.finalize`` on the storage: PyTorch keeps a storage's
Python object alive as long as the storage), and the largest sum is the peak. Storages that exist
before the step (parameters, fp32 ``main_grad``s, the input, the output gradient) are not counted,
as ``bench_layernorm_modules.py`` subtracts them from ``max_memory_allocated``; neither are
temporaries a kernel allocates and frees inside itself (no op returns them). Every variant
accumulates its GEMMs' gradients into fp32 ``main_grad`` (plain PyTorch by a post-accumulate-grad
hook, as Megatron does) and the norm's into ``main_grad`` by that hook, as the benchmark does.
Results are in units of fc2's input (tokens x ffn x 2 bytes in bf16).

The emulations (Python autograd Functions, for this measurement only) check themselves: splitgrad's
delayed module must peak no higher than the recomputing one (it can peak lower: its activation
backward writes a gated gradient's two halves into one result, where autograd makes each half and
concatenates them), and the recomputed activation must equal the forward's bit for bit (same
kernels, same input), so the recomputing runner gives the gradients of keeping fc2's input.

    python benchmarks/mem_layernorm_mlp.py                      # hidden 512, ffn 1792, 2048 tokens
    python benchmarks/mem_layernorm_mlp.py --activation gelu --normalization LayerNorm
"""

from __future__ import annotations

import argparse
import sys
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

import splitgrad

GATED = ("swiglu", "geglu", "reglu")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created by ops under the mode and still alive; their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, tuple[str, int]] = {}  # storage -> (op, bytes)
        self.at_peak: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views, in-place results and aliases live in their inputs' storages: not new
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t._is_view()
                    and t.untyped_storage().data_ptr() not in inputs):
                self._count(t.untyped_storage(), str(func).replace("aten.", ""))
        return out

    def _count(self, storage, op: str) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        self._alive[key] = (op, storage.nbytes())
        self.live += storage.nbytes()
        if self.live > self.peak:
            self.peak, self.at_peak = self.live, sorted(self._alive.values(), key=lambda v: -v[1])
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._alive.pop(key)[1]


def activation(name: str, h: torch.Tensor, inplace_gate: bool = False) -> torch.Tensor:
    """TE's activations (gelu is the tanh approximation; gated ones act on the first half).
    ``inplace_gate``: act(a) *= b in place, as a recompute outside autograd can do."""
    fn = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "silu": F.silu}[
        {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}.get(name, name)]
    if name not in GATED:
        return fn(h)
    a, b = h.chunk(2, dim=-1)
    return fn(a).mul_(b) if inplace_gate else fn(a) * b


def _fold_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def with_main_grads(params: dict[str, torch.Tensor], hook: callable) -> None:
    """fp32 main_grad on every parameter; ``hook(name)`` says whose .grad a hook folds into it."""
    for name, p in params.items():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        if hook(name):
            p.register_post_accumulate_grad_hook(_fold_into_main_grad)


class DeferredLinear(torch.autograd.Function):
    """Emulation of a deferred-wgrad linear map without bias: the backward computes dgrad and
    queues (weight, keep, recompute, grad_output); backward_dw adds grad_outputᵀ·recompute(keep)."""

    @staticmethod
    def forward(ctx, x, weight, keep, recompute, queue):
        ctx.weight, ctx.keep, ctx.recompute, ctx.queue = weight, keep, recompute, queue
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.queue.append((ctx.weight, ctx.keep, ctx.recompute, grad_output))
        ctx.keep = None
        return grad_output @ ctx.weight, None, None, None, None


VARIANTS = ("plain PyTorch", "splitgrad delayed", "splitgrad immediate", "emulated delayed, fc2 keeps its input",
            "emulated delayed, fc2 keeps fc1's output (recompute)")


def measure(hidden: int, ffn: int, tokens: int, act: str = "swiglu", normalization: str = "RMSNorm",
            dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[int, int, list]]:
    """{variant: (peak bytes, bytes held after the backward, storages alive at the peak)}."""
    H, FFN, T = hidden, ffn, tokens
    torch.manual_seed(0)
    base = splitgrad.LayerNormMLP(H, FFN, normalization=normalization, activation=act, params_dtype=dtype,
                                  device="cpu")
    x0, gy = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)

    def norm(x, p):
        if normalization == "LayerNorm":
            return F.layer_norm(x, (H,), p["layer_norm_weight"], p["layer_norm_bias"], base.eps)
        return F.rms_norm(x, (H,), p["layer_norm_weight"], base.eps)

    def copies():
        return {n: torch.nn.Parameter(p.detach().clone()) for n, p in base.named_parameters()}

    def plain():
        p = copies()
        with_main_grads(p, lambda name: True)

        def fwd(x):
            h = F.linear(norm(x, p), p["fc1_weight"], p["fc1_bias"])
            return F.linear(activation(act, h), p["fc2_weight"], p["fc2_bias"])
        return fwd, lambda: None

    def module(delay):
        m = splitgrad.LayerNormMLP(H, FFN, normalization=normalization, activation=act, params_dtype=dtype,
                                   device="cpu", delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
        m.load_state_dict(base.state_dict())
        with_main_grads(dict(m.named_parameters()), lambda name: name.startswith("layer_norm"))
        return m, m.backward_dw

    def emulated(recompute: bool):
        p, queue = copies(), []
        with_main_grads(p, lambda name: not name.endswith("_weight") or name.startswith("layer_norm"))

        def fwd(x):
            ln = norm(x, p)
            h = DeferredLinear.apply(ln, p["fc1_weight"], ln, None, queue) + p["fc1_bias"]
            a = activation(act, h)
            if recompute:
                out = DeferredLinear.apply(a, p["fc2_weight"], h, lambda t: activation(act, t, inplace_gate=True),
                                           queue)
            else:
                out = DeferredLinear.apply(a, p["fc2_weight"], a, None, queue)
            return out + p["fc2_bias"]

        def backward_dw():
            while queue:
                weight, keep, again, grad_output = queue.pop(0)
                inp = again(keep) if again else keep
                del keep
                with _disable_current_modes():  # splitgrad's GEMM accumulates into main_grad: no temporary
                    weight.main_grad.add_(grad_output.t() @ inp)
                del inp, grad_output
        return fwd, backward_dw

    # The recomputed activation is the forward's, bit for bit.
    h = torch.randn(T, (2 if act in GATED else 1) * FFN).to(dtype)
    assert torch.equal(activation(act, h), activation(act, h.clone(), inplace_gate=True))

    steps = dict(zip(VARIANTS, (plain(), module(True), module(False), emulated(False), emulated(True))))
    results = {}
    for name, (fwd, backward_dw) in steps.items():
        x = x0.clone().requires_grad_(True)
        with LiveBytes() as mode:
            out = fwd(x)
            out.backward(gy)
            del out
            held = mode.live
            backward_dw()
        results[name] = (mode.peak, held, mode.at_peak)
    # splitgrad's delayed module recomputes as the second emulation does
    assert results[VARIANTS[1]][0] <= results[VARIANTS[4]][0], {k: v[:2] for k, v in results.items()}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1792)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--activation", default="swiglu", choices=["gelu", "relu", "silu", *GATED])
    parser.add_argument("--normalization", default="RMSNorm", choices=["LayerNorm", "RMSNorm"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--detail", action="store_true", help="print the storages alive at each peak")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    results = measure(args.hidden, args.ffn, args.tokens, args.activation, args.normalization, dtype)
    unit = args.tokens * args.ffn * torch.finfo(dtype).bits // 8
    print(f"LayerNormMLP hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens, {args.normalization}, "
          f"{args.activation}, {args.dtype}, CPU (torch {torch.__version__}); unit = fc2's input = {unit} bytes")
    print("| variant | peak MiB | peak / unit | peak vs plain | held after backward / unit |")
    print("|---|---:|---:|---:|---:|")
    plain_peak = results[VARIANTS[0]][0]
    for name, (peak, held, at_peak) in results.items():
        print(f"| {name} | {peak / 2**20:.2f} | {peak / unit:.3f} | {peak / plain_peak:.3f} | {held / unit:.3f} |")
        if args.detail:
            print("    at the peak: " + ", ".join(f"{op} {n / unit:.2f}" for op, n in at_peak if n >= unit / 50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
