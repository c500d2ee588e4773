"""A small GPT-style character language model, built from pieces that a pipeline cuts into stages.

Pieces: ``Embedding`` (token + position embedding), ``Block`` x layers (pre-norm causal
self-attention and MLP), ``Head`` (final norm and the output layer). The output layer is tied to the
token embedding, as in GPT models. ``linear`` builds every projection, so one model definition gives
both the splitgrad model (``splitgrad.Linear(..., delay_wgrad_compute=True)``) and its plain-PyTorch
twin (``nn.Linear``) with the same initial values.
"""

from __future__ import annotations

import pathlib

import torch
import torch.nn.functional as F
from torch import nn

CORPUS_PATH = pathlib.Path(__file__).resolve().parent / "data" / "corpus.txt"


class CharTokenizer:
    """Characters to ids and back; the vocabulary is the corpus's characters."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


def load_corpus() -> tuple[CharTokenizer, torch.Tensor]:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    return tokenizer, tokenizer.encode(text)


def batch(data: torch.Tensor, step: int, sequences: int, context: int, seed: int = 0):
    """``sequences`` random windows of ``context`` tokens and their next-token targets, the same in
    every process for the same ``step`` (a generator seeded by step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context - 1, (sequences,), generator=g)
    windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        nn.init.normal_(self.tokens.weight, std=0.02)  # GPT's init: the tied output layer starts small
        self.positions = nn.Parameter(torch.zeros(context, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; ``linear`` builds every projection."""

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
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int, linear) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_pieces(linear, *, vocab: int, dim: int, heads: int, layers: int, context: int, seed: int,
                 device="cpu", dtype=torch.float32) -> list[nn.Module]:
    """[Embedding, Block x layers, Head] with the same initial values for any ``linear`` and in any
    process; the output layer's weight starts equal to the token embedding's (tie it, or keep the
    copies equal with splitgrad.pipelining.TiedParameter)."""
    torch.manual_seed(seed)
    pieces = [Embedding(vocab, dim, context)]
    pieces += [Block(dim, heads, linear) for _ in range(layers)]
    pieces.append(Head(dim, vocab, linear))
    with torch.no_grad():
        pieces[-1].out.weight.copy_(pieces[0].tokens.weight)
    return [p.to(device=device, dtype=dtype) for p in pieces]


def tie(pieces: list[nn.Module]) -> None:
    """One Parameter for the token embedding and the output layer (single-process models)."""
    pieces[-1].out.weight = pieces[0].tokens.weight


def stage_pieces(num_pieces: int, stage: int, num_stages: int) -> list[int]:
    """The piece indices of ``stage``: blocks spread evenly (the earlier stages take one more where
    they do not divide), the embedding on the first stage and the head on the last."""
    layers = num_pieces - 2
    if num_stages > layers:
        raise ValueError(f"{num_stages} stages need at least as many blocks, got {layers} (raise --layers)")
    counts = [layers // num_stages + (1 if s < layers % num_stages else 0) for s in range(num_stages)]
    first = 1 + sum(counts[:stage])
    indices = list(range(first, first + counts[stage]))
    if stage == 0:
        indices.insert(0, 0)
    if stage == num_stages - 1:
        indices.append(num_pieces - 1)
    return indices


def stage_module(pieces: list[nn.Module], stage: int, num_stages: int) -> nn.Sequential:
    """An ``nn.Sequential`` of the stage's pieces, named by piece index, so its parameter names are
    those of ``nn.Sequential(*pieces)`` (the whole model)."""
    module = nn.Sequential()
    for i in stage_pieces(len(pieces), stage, num_stages):
        module.add_module(str(i), pieces[i])
    return module


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
