"""A small GPT-style character language model, built from pieces that a pipeline cuts into stages.

Pieces: ``Embedding`` (token + position embedding), ``Block`` x layers (pre-norm causal
self-attention and MLP), ``Head`` (final norm and the output layer). The output layer is tied to the
token embedding, as in GPT models. A block is built as a Transformer Engine user builds it: the QKV
projection with the first norm fused in (``te.LayerNormLinear``), the attention's output projection
(``te.Linear``), the MLP with the second norm fused in (``te.LayerNormMLP``, TE's ``"gelu"``).
``Layers`` says what builds those three, so one model definition gives both the splitgrad model
(splitgrad's modules, from examples/demo.py) and its plain-PyTorch twin (``plain_layers``:
``nn.LayerNorm``, ``nn.Linear`` and the activation) with the same initial values. With ``experts``,
each block's MLP is a top-k routed mixture of experts instead (``MoEMLP``), its experts built by
``Layers.grouped_linear`` (splitgrad.GroupedLinear, or ``PlainGroupedLinear``'s per-expert F.linear).
"""

from __future__ import annotations

import math
import pathlib
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

CORPUS_PATH = pathlib.Path(__file__).resolve().parent / "data" / "corpus.txt"

#: The MLP's activation, by TE's name: TE's "gelu" is the tanh approximation.
ACTIVATION = "gelu"


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


class Layers(NamedTuple):
    """What builds a model's layers: ``linear(in, out, bias=True)``,
    ``layernorm_linear(in, out)`` (LayerNorm, then the linear map) and
    ``layernorm_mlp(hidden, ffn)`` (LayerNorm, fc1, ACTIVATION, fc2), with TE's parameter names or
    with ``TE_NAMES`` mapping theirs to TE's (``te_named_parameters``); for MoE models,
    ``grouped_linear(experts, in, out)`` (te.GroupedLinear's ``forward(x, m_splits)``)."""

    linear: Callable[..., nn.Module]
    layernorm_linear: Callable[[int, int], nn.Module]
    layernorm_mlp: Callable[[int, int], nn.Module]
    grouped_linear: Callable[[int, int, int], nn.Module] | None = None


class PlainLayerNormLinear(nn.Module):
    """te.LayerNormLinear's function in plain PyTorch: nn.LayerNorm, then nn.Linear."""

    TE_NAMES = {"norm.weight": "layer_norm_weight", "norm.bias": "layer_norm_bias", "linear.weight": "weight",
                "linear.bias": "bias"}

    def __init__(self, i: int, o: int, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(i, device=device, dtype=dtype)
        self.linear = nn.Linear(i, o, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class PlainLayerNormMLP(nn.Module):
    """te.LayerNormMLP's function in plain PyTorch: nn.LayerNorm, nn.Linear, TE's "gelu" (the tanh
    approximation), nn.Linear."""

    TE_NAMES = {"norm.weight": "layer_norm_weight", "norm.bias": "layer_norm_bias", "fc1.weight": "fc1_weight",
                "fc1.bias": "fc1_bias", "fc2.weight": "fc2_weight", "fc2.bias": "fc2_bias"}

    def __init__(self, hidden: int, ffn: int, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = nn.Linear(hidden, ffn, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class PlainGroupedLinear(nn.Module):
    """te.GroupedLinear's function in plain PyTorch: one F.linear per expert on its rows, with its
    parameters in its order (``weight0``, ``bias0``, ``weight1``, …) and splitgrad.GroupedLinear's
    initialisation (each expert as nn.Linear's, expert by expert)."""

    def __init__(self, experts: int, i: int, o: int, device=None, dtype=None) -> None:
        super().__init__()
        self.experts = experts
        for e in range(experts):
            self.register_parameter(f"weight{e}", nn.Parameter(torch.empty(o, i, device=device, dtype=dtype)))
            self.register_parameter(f"bias{e}", nn.Parameter(torch.empty(o, device=device, dtype=dtype)))
        with torch.no_grad():
            for e in range(experts):
                nn.init.kaiming_uniform_(getattr(self, f"weight{e}"), a=math.sqrt(5))
                nn.init.uniform_(getattr(self, f"bias{e}"), -1 / math.sqrt(i), 1 / math.sqrt(i))

    def forward(self, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
        rows = x.split(m_splits.tolist())  # the reference may read the counts on the host
        return torch.cat([F.linear(r, getattr(self, f"weight{e}"), getattr(self, f"bias{e}"))
                          for e, r in enumerate(rows)])


def plain_layers(device=None, dtype=None) -> Layers:
    """The plain-PyTorch twin's layers (the reference the splitgrad model is checked against)."""
    return Layers(
        linear=lambda i, o, bias=True: nn.Linear(i, o, bias, device=device, dtype=dtype),
        layernorm_linear=lambda i, o: PlainLayerNormLinear(i, o, device=device, dtype=dtype),
        layernorm_mlp=lambda h, f: PlainLayerNormMLP(h, f, device=device, dtype=dtype),
        grouped_linear=lambda n, i, o: PlainGroupedLinear(n, i, o, device=device, dtype=dtype),
    )


def te_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model.named_parameters(remove_duplicate=False)`` under TE's parameter names: a plain
    twin's ``qkv.norm.weight`` as ``qkv.layer_norm_weight`` (its modules' ``TE_NAMES``), so its
    parameters and the splitgrad model's match by name."""
    renamed = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, te in getattr(module, "TE_NAMES", {}).items():
            renamed[f"{prefix}.{local}" if prefix else local] = f"{prefix}.{te}" if prefix else te
    return {renamed.get(n, n): p for n, p in model.named_parameters(remove_duplicate=False)}


class MoEMLP(nn.Module):
    """A top-k routed mixture-of-experts MLP: ``norm`` (nn.LayerNorm), ``router`` (a linear map to
    one logit per expert), then each token through its ``topk`` experts (``fc1``, ACTIVATION, ``fc2``:
    ``layers.grouped_linear``), their outputs weighted by the softmax of the chosen logits."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, layers: Layers) -> None:
        super().__init__()
        self.experts, self.topk = experts, topk
        self.norm = nn.LayerNorm(hidden)
        self.router = layers.linear(hidden, experts, bias=False)
        self.fc1 = layers.grouped_linear(experts, hidden, ffn)
        self.fc2 = layers.grouped_linear(experts, ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(x).reshape(-1, x.shape[-1])
        logits, chosen = self.router(tokens).topk(self.topk, dim=-1)  # [tokens, k]
        gates = logits.softmax(dim=-1)
        # The (token, expert) pairs sorted by expert, so that each expert's rows are contiguous.
        order = chosen.flatten().argsort(stable=True)
        rows = tokens[order // self.topk]
        # Rows per expert, counted on the device (bincount would read its maximum on the host).
        m_splits = torch.zeros(self.experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, chosen.flatten(), torch.ones_like(chosen.flatten()))
        out = self.fc2(F.gelu(self.fc1(rows, m_splits), approximate="tanh"), m_splits)
        out = out[order.argsort()].view(-1, self.topk, x.shape[-1])  # back to (token, choice) order
        return (out * gates.unsqueeze(-1)).sum(dim=1).view(x.shape)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, as a TE GPT's: ``qkv`` (the first norm and the QKV
    projection), ``proj``, ``mlp`` (the second norm, fc1, the activation, fc2; with ``experts``, a
    ``MoEMLP`` whose experts have hidden size 4·dim / topk, so that a token costs what it does in
    the dense MLP)."""

    def __init__(self, dim: int, heads: int, layers: Layers, experts: int = 0, topk: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = layers.layernorm_linear(dim, 3 * dim)
        self.proj = layers.linear(dim, dim)
        if experts:
            self.mlp = MoEMLP(dim, max(1, 4 * dim // topk), experts, topk, layers)
        else:
            self.mlp = layers.layernorm_mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int, layers: Layers) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = layers.linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_pieces(kit: Layers, *, vocab: int, dim: int, heads: int, layers: int, context: int, seed: int,
                 experts: int = 0, topk: int = 2, device="cpu", dtype=torch.float32) -> list[nn.Module]:
    """[Embedding, Block x layers, Head] with the same initial values for any ``kit`` and in any
    process (norms start at 1 and 0; the linear maps draw nn.Linear's initialisation in the same
    order); the output layer's weight starts equal to the token embedding's (tie it, or keep the
    copies equal with splitgrad.pipelining.TiedParameter). ``experts`` > 0: MoE blocks, each token
    routed to ``topk`` of them."""
    torch.manual_seed(seed)
    pieces = [Embedding(vocab, dim, context)]
    pieces += [Block(dim, heads, kit, experts, topk) for _ in range(layers)]
    pieces.append(Head(dim, vocab, kit))
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
