"""splitgrad's main job: train a small language model with deferred weight gradients, side by side
with the same model trained by plain PyTorch autograd, and show that the gradients agree.

The model is a tiny GPT-style character model: a token embedding tied to the output layer (as in GPT
models: one Parameter, two users), causal self-attention and MLP blocks whose projections are
splitgrad.Linear layers with delay_wgrad_compute=True. Each step runs several micro-batches in a
zero-bubble-like order (F0 B0 F1 W0 B1 W1 ...): the weight gradients of micro-batch i are computed by
backward_dw() only after the backward pass of micro-batch i+1.

    python examples/demo.py [--steps 150] [--micro-batches 4] [--device cpu|cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import splitgrad

CORPUS = """\
the quick brown fox jumps over the lazy dog. a small model learns the shape of its text one
character at a time. weights that are tied share one gradient, and every user of a weight must add
its part: the embedding that reads a token and the output layer that writes it. when the weight
gradient is deferred, the input gradient runs first so the previous stage can go on, and the weight
gradient runs later to fill the bubbles of the pipeline. deferred or not, the sum must be the same.
"""


class Tokenizer:
    """Characters to ids and back."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; `linear` builds every projection."""

    def __init__(self, dim: int, heads: int, linear) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = linear(dim, 3 * dim)
        self.proj = linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = linear(dim, 4 * dim)
        self.fc2 = linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, context: int, linear) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT's init: the tied output layer starts small
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, linear) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two users

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_models(args, vocab: int):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def delayed_linear(i, o, bias=True):
        return splitgrad.Linear(i, o, bias, params_dtype=dtype, device=device, delay_wgrad_compute=True)

    def plain_linear(i, o, bias=True):
        return nn.Linear(i, o, bias, dtype=dtype, device=device)

    torch.manual_seed(args.seed)
    shape = dict(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, context=args.context)
    model = TinyGPT(**shape, linear=delayed_linear).to(device=device, dtype=dtype)
    reference = TinyGPT(**shape, linear=plain_linear).to(device=device, dtype=dtype)
    reference.load_state_dict(model.state_dict())
    splitgrad.name_layers(model)
    return model, reference


def batches(data: torch.Tensor, args, generator: torch.Generator):
    """`micro_batches` random windows of `context + 1` characters each."""
    starts = torch.randint(0, len(data) - args.context - 1, (args.micro_batches, args.batch), generator=generator)
    for row in starts:
        window = torch.stack([data[s : s + args.context + 1] for s in row.tolist()])
        yield window[:, :-1].to(args.device), window[:, 1:].to(args.device)


def loss_of(model, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def deferred_layers(model) -> list[splitgrad.Linear]:
    return [m for m in model.modules() if isinstance(m, splitgrad.Linear) and m.delay_wgrad_compute]


def train_step(model, reference, micro_batches, layers) -> tuple[float, float]:
    """One step. splitgrad: F0 B0 F1 W0 B1 W1 ... (W = backward_dw of every layer, last layer first).
    Reference: plain autograd over the same micro-batches."""
    total, reference_total = 0.0, 0.0
    scale = 1.0 / len(micro_batches)
    for i, (inputs, targets) in enumerate(micro_batches):
        loss = loss_of(model, inputs, targets)
        (loss * scale).backward()  # B_i: dgrad only for the splitgrad layers
        total += loss.item() * scale
        if i > 0:
            for layer in reversed(layers):  # W_{i-1}: fills the slot a pipeline bubble would take
                layer.backward_dw()
        reference_loss = loss_of(reference, inputs, targets)
        (reference_loss * scale).backward()
        reference_total += reference_loss.item() * scale
    for layer in reversed(layers):  # W of the last micro-batch
        layer.backward_dw()
    assert splitgrad.pending_wgrads() == 0
    return total, reference_total


def compare_grads(model, reference) -> tuple[float, str]:
    """Largest |gradient difference| over all parameters, and how many gradients are bit-identical."""
    worst, exact, total = 0.0, 0, 0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{name}: gradient present in one model only")
        if p.grad is not None:
            total += 1
            exact += int(torch.equal(p.grad, q.grad))
            worst = max(worst, (p.grad.float() - q.grad.float()).abs().max().item())
    return worst, f"{exact}/{total}"


def write_loss_plot(path: str, losses: list[float], reference_losses: list[float]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, reference_losses, label="plain autograd", linewidth=3, alpha=0.5)
    ax.plot(steps, losses, label="splitgrad, delayed wgrad", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Tied-embedding language model: deferred vs plain gradients")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=None, help="largest gradient difference accepted")
    parser.add_argument("--out", default="out", help="folder for the loss-curve PNG")
    args = parser.parse_args(argv)
    if args.micro_batches < 1 or args.steps < 1:
        parser.error("--steps and --micro-batches must be at least 1")
    tolerance = args.tolerance if args.tolerance is not None else (1e-5 if args.dtype == "float32" else 5e-2)

    tokenizer = Tokenizer(CORPUS)
    data = tokenizer.encode(CORPUS)
    model, reference = build_models(args, tokenizer.vocab_size)
    layers = deferred_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(args.seed)

    print(
        f"splitgrad demo: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(layers)} delayed splitgrad.Linear layers (output layer tied to the embedding), "
        f"{args.micro_batches} micro-batches per step, {args.device}, {args.dtype}"
    )
    rows = []
    losses, reference_losses = [], []
    start = time.perf_counter()
    progress = tqdm(range(1, args.steps + 1), desc="training", unit="step", mininterval=0.5)
    for step in progress:
        micro_batches = list(batches(data, args, generator))
        # Lockstep: the reference starts every step from splitgrad's parameters, so the difference
        # measures this step's gradients alone (chaotic training would amplify last-bit differences).
        reference.load_state_dict(model.state_dict())
        optimizer.zero_grad()
        reference.zero_grad()
        loss, reference_loss = train_step(model, reference, micro_batches, layers)
        grad_difference, exact = compare_grads(model, reference)
        optimizer.step()
        losses.append(loss)
        reference_losses.append(reference_loss)
        rows.append((step, loss, reference_loss, grad_difference, exact))
        progress.set_postfix(loss=f"{loss:.4f}", max_grad_diff=f"{grad_difference:.2e}")
    elapsed = time.perf_counter() - start

    interval = max(1, args.steps // 10)
    shown = {1, *range(interval, args.steps + 1, interval), args.steps}
    print()
    header = f"{'step':>5} | {'loss (splitgrad)':>16} | {'loss (autograd)':>15} | {'max |grad diff|':>15} | {'bit-exact grads':>15}"
    print(header)
    print("-" * len(header))
    for step, loss, reference_loss, grad_difference, exact in rows:
        if step in shown:
            print(f"{step:>5} | {loss:>16.5f} | {reference_loss:>15.5f} | {grad_difference:>15.2e} | {exact:>15}")
    worst_grad = max(r[3] for r in rows)
    print("-" * len(header))
    print(f"loss {rows[0][1]:.4f} -> {rows[-1][1]:.4f} in {args.steps} steps ({elapsed:.1f} s)")
    print(f"largest gradient difference vs plain autograd over all steps: {worst_grad:.2e} (tolerance {tolerance:.0e})")
    os.makedirs(args.out, exist_ok=True)
    plot = os.path.join(args.out, "demo_loss.png")
    if write_loss_plot(plot, losses, reference_losses):
        print(f"loss curve: {plot}")
    ok = worst_grad <= tolerance and math.isfinite(rows[-1][1])
    print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
