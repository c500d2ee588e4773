"""Property test: random models and schedules give plain autograd's gradients.

A scenario is: N layers of one width; random tying groups of weights and of biases; random delay
flags; a random forward program that may apply a layer several times; 1–4 micro-batches run in a
random interleaving of forwards (F), backwards (B) and deferred-work steps (W: backward_dw() on a
random layer with work pending, so a micro-batch's W always follows its B); leftover work run
layer by layer in a random order or by backward_dw_all(); a random dtype; random pre-existing
gradients; sometimes every layer fused into fp32 main_grad. A layer is a Linear, a
LayerNormLinear (LayerNorm or RMSNorm, its norm's gradients immediate) or a GroupedLinear of 1–4
experts (MoE), tied with the others alike (a GroupedLinear through its expert 0's weight and bias,
and sometimes its expert 1's weight tied to expert 0's). Each application of a GroupedLinear in
each micro-batch routes the rows anew: random splits with zeros, or one expert taking all rows,
given as a list or as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

import splitgrad
from sg_helpers import as_dtype, assert_grads_match, gradient_of, to_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class Scenario:
    width: int
    weight_owner: list[int]      # layer i uses layer weight_owner[i]'s weight (itself: its own)
    bias_owner: list[int | None]  # None: no bias
    delay: list[bool]
    program: list[int]           # layers applied in order (repeats = reuse)
    tokens: tuple[int, ...]      # leading input dims
    microbatches: int
    steps: list[tuple]           # ("F", i) / ("B", i) / ("W", pick)
    leftover: str | list[int]    # "all" or an order of layers
    dtype: torch.dtype
    fuse: bool
    pre_grad: list[bool]         # per layer: weight, then bias
    first_microbatch_flag: bool
    seed: int
    kinds: list[str]             # per layer: "Linear", "Grouped", or a LayerNormLinear's normalization
    experts: list[int]           # per layer: a GroupedLinear's experts (0 for the others)
    tie_experts: list[bool]      # per layer: a GroupedLinear's weight1 is its weight0
    routing: list[list]          # per micro-batch, per application: a GroupedLinear's m_splits, else None
    splits_tensor: bool          # m_splits as an int64 tensor rather than a list


KINDS = ["Linear", "LayerNorm", "RMSNorm", "Grouped"]


def rows_of(tokens: tuple[int, ...]) -> int:
    rows = 1
    for t in tokens:
        rows *= t
    return rows


def draw_splits(draw, rows: int, experts: int) -> list[int]:
    """Rows per expert: one expert taking them all, or random cuts (zeros where cuts coincide)."""
    if draw(st.integers(0, 3)) == 0:
        splits = [0] * experts
        splits[draw(st.integers(0, experts - 1))] = rows
        return splits
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=experts - 1, max_size=experts - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, rows])]


@st.composite
def scenarios(draw) -> Scenario:
    n = draw(st.integers(1, 4))
    weight_owner, bias_owner = [], []
    for i in range(n):
        weight_owner.append(weight_owner[draw(st.integers(0, i - 1))] if i and draw(st.booleans()) else i)
        if draw(st.booleans()):
            bias_owner.append(None)
        else:
            with_bias = [b for b in bias_owner if b is not None]
            bias_owner.append(draw(st.sampled_from(with_bias)) if with_bias and draw(st.booleans()) else i)
    delay = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if not any(delay):
        delay[draw(st.integers(0, n - 1))] = True
    program = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5))
    m = draw(st.integers(1, 4))
    # a random interleaving of each micro-batch's F then B, with W steps after the B steps
    todo = {i: ["F", "B"] for i in range(m)}
    steps = []
    while todo:
        i = draw(st.sampled_from(sorted(todo)))
        kind = todo[i].pop(0)
        steps.append((kind, i))
        if not todo[i]:
            del todo[i]
        if kind == "B":
            steps += [("W", draw(st.integers(0, 99))) for _ in range(draw(st.integers(0, 2)))]
    leftover = draw(st.one_of(st.just("all"), st.permutations(range(n)).map(list)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    experts = [draw(st.integers(1, 4)) if kind == "Grouped" else 0 for kind in kinds]
    tie_experts = [e > 1 and draw(st.booleans()) for e in experts]
    tokens = draw(st.sampled_from([(), (3,), (2, 3)]))
    routing = [[draw_splits(draw, rows_of(tokens), experts[i]) if experts[i] else None for i in program]
               for _ in range(m)]
    return Scenario(
        width=draw(st.sampled_from([4, 8])),
        weight_owner=weight_owner,
        bias_owner=bias_owner,
        delay=delay,
        program=program,
        tokens=tokens,
        microbatches=m,
        steps=steps,
        leftover=leftover,
        dtype=draw(st.sampled_from(DTYPES)),
        fuse=draw(st.integers(0, 4)) == 0,
        pre_grad=draw(st.lists(st.booleans(), min_size=2 * n, max_size=2 * n)),
        first_microbatch_flag=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        kinds=kinds,
        experts=experts,
        tie_experts=tie_experts,
        routing=routing,
        splits_tensor=draw(st.booleans()),
    )


class Program(nn.Module):
    def __init__(self, layers, program):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.program = program

    def forward(self, x, routing, is_first_microbatch=None):
        for k, i in enumerate(self.program):
            splits = () if routing[k] is None else (routing[k],)  # a GroupedLinear's m_splits
            x = self.layers[i](x, *splits, is_first_microbatch=is_first_microbatch)
            if k + 1 < len(self.program):
                x = torch.tanh(x)
        return x


def weights_of(layer: nn.Module) -> list[nn.Parameter]:
    return layer.weights if isinstance(layer, splitgrad.GroupedLinear) else [layer.weight]


def biases_of(layer: nn.Module) -> list[nn.Parameter]:
    if isinstance(layer, splitgrad.GroupedLinear):
        return layer.biases
    return [] if layer.bias is None else [layer.bias]


def tie(layer: nn.Module, what: str, k: int, param: nn.Parameter) -> None:
    """Makes ``param`` the layer's weight (``what`` = "weight") or bias; expert ``k``'s in a
    GroupedLinear."""
    setattr(layer, f"{what}{k}" if isinstance(layer, splitgrad.GroupedLinear) else what, param)


def build(s: Scenario) -> Program:
    def make(i):
        kw = dict(bias=s.bias_owner[i] is not None, params_dtype=s.dtype, device="cpu",
                  delay_wgrad_compute=s.delay[i], fuse_wgrad_accumulation=s.fuse)
        if s.kinds[i] == "Linear":
            return splitgrad.Linear(s.width, s.width, **kw)
        if s.kinds[i] == "Grouped":
            return splitgrad.GroupedLinear(s.experts[i], s.width, s.width, **kw)
        return splitgrad.LayerNormLinear(s.width, s.width, normalization=s.kinds[i], **kw)

    layers = [make(i) for i in range(len(s.delay))]
    for i, layer in enumerate(layers):
        tie(layer, "weight", 0, weights_of(layers[s.weight_owner[i]])[0])
        if s.bias_owner[i] is not None:
            tie(layer, "bias", 0, biases_of(layers[s.bias_owner[i]])[0])
        if s.tie_experts[i]:
            tie(layer, "weight", 1, weights_of(layer)[0])
    model = Program(layers, s.program)
    generator = torch.Generator().manual_seed(s.seed)
    for i, layer in enumerate(layers):
        for j, params in enumerate((weights_of(layer), biases_of(layer))):
            for param in params if s.pre_grad[2 * i + j] else []:
                if gradient_of(param) is not None:  # tied: started already
                    continue
                start = torch.randn(param.shape, generator=generator)
                if s.fuse:
                    param.main_grad = start
                else:
                    param.grad = start.to(s.dtype)
    if s.fuse:  # the GEMMs' parameters (a norm's gradients go to .grad)
        for param in _gemm_params(model):
            if getattr(param, "main_grad", None) is None:
                param.main_grad = torch.zeros(param.shape)
            param.grad_added_to_main_grad = False
    return model


def _gemm_params(model: Program) -> list[torch.Tensor]:
    return [p for layer in model.layers for p in (*weights_of(layer), *biases_of(layer))]


def terms_per_parameter(s: Scenario, model: Program) -> dict[str, int]:
    """How many terms each parameter's gradient is a sum of (pre-existing value + one per use; an
    expert's use counts even when it gets no rows)."""
    terms = {}
    for name, param in model.named_parameters():
        layers = [model.layers[i] for i in s.program]
        uses = sum(1 for layer in layers for p in (*weights_of(layer), *biases_of(layer)) if p is param)
        pre = getattr(param, "main_grad", None) if s.fuse else param.grad
        terms[name] = uses * s.microbatches + (1 if pre is not None and pre.any() else 0)
    return terms


def run(s: Scenario, model: Program, inputs, grad_outputs, deferred: bool) -> None:
    outputs = {}
    layers = list(model.layers)
    for kind, i in s.steps:
        if kind == "F":
            flag = (i == 0) if s.first_microbatch_flag else None
            routing = [torch.tensor(r) if r is not None and s.splits_tensor else r for r in s.routing[i]]
            outputs[i] = model(inputs[i], routing, is_first_microbatch=flag)
        elif kind == "B":
            outputs.pop(i).backward(grad_outputs[i])
        elif deferred:
            pending = [layer for layer in layers if layer.delay_wgrad_compute and layer.pending_wgrads()]
            if pending:
                pending[i % len(pending)].backward_dw()
    if not deferred:
        return
    if s.leftover == "all":
        splitgrad.backward_dw_all()
    else:
        while splitgrad.pending_wgrads():
            for i in s.leftover:
                if layers[i].pending_wgrads():
                    layers[i].backward_dw()
    assert splitgrad.pending_wgrads() == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_random_models_match_plain_autograd(s: Scenario):
    note(repr(s))
    model = build(s)
    reference = to_reference(model)
    high = to_reference(model, torch.float64)
    generator = torch.Generator().manual_seed(s.seed + 1)
    shape = (*s.tokens, s.width)
    inputs = [torch.randn(shape, generator=generator).to(s.dtype) for _ in range(s.microbatches)]
    grad_outputs = [torch.randn(shape, generator=generator).to(s.dtype) for _ in range(s.microbatches)]
    # float32 sums of at most two terms cannot depend on their order: bit for bit (main_grad too:
    # float32 products added to a float32 buffer, as autograd adds them to .grad)
    exact = s.dtype == torch.float32 and max(terms_per_parameter(s, model).values(), default=0) <= 2

    run(s, model, inputs, grad_outputs, deferred=True)
    run(s, reference, inputs, grad_outputs, deferred=False)
    run(s, high, as_dtype(inputs, torch.float64), as_dtype(grad_outputs, torch.float64), deferred=False)

    if s.fuse:
        for param in _gemm_params(model):
            assert param.grad is None
    assert_grads_match(model, reference, exact=exact, high_precision=high)
