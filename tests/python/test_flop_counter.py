"""torch.utils.flop_counter.FlopCounterMode counts splitgrad's GEMMs as it counts nn.Linear's
(2·rows·in·out per product: fprop, dgrad, wgrad), deferred ones where backward_dw() runs them,
grouped ones whatever the routing; registered however the two modules are imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import splitgrad
from sg_helpers import to_reference


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


def _model(kind: str, delay: bool) -> nn.Module:
    kw = dict(device="cpu", delay_wgrad_compute=delay)
    return {"Linear": lambda: splitgrad.Linear(8, 6, **kw),
            "LayerNormLinear": lambda: splitgrad.LayerNormLinear(8, 6, **kw),
            "LayerNormMLP": lambda: splitgrad.LayerNormMLP(8, 12, activation="swiglu", **kw),
            "GroupedLinear": lambda: splitgrad.GroupedLinear(3, 8, 6, **kw)}[kind]()


@pytest.mark.parametrize("delay", [False, True], ids=["regular", "delayed"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_counts_as_the_plain_model(kind, delay):
    model = _model(kind, delay)
    reference = to_reference(model)
    x = torch.randn(2, 5, 8, requires_grad=True)
    args = (x, [4, 0, 6]) if kind == "GroupedLinear" else (x,)

    def step(m):
        def run():
            m(*args).pow(2).sum().backward()
            if m is model and delay:
                model.backward_dw()
        return run

    expected = _flops(step(reference))
    assert expected > 0
    assert _flops(step(model)) == expected
    # forward alone, and the deferred part alone
    assert _flops(lambda: model(*args)) == _flops(lambda: reference(*args))
    if delay:
        model(*args).sum().backward()
        # one wgrad per GEMM of the module: 2·rows·in·out (a grouped layer's rows each go through one expert)
        gemm_weights = [p for n, p in model.named_parameters() if "weight" in n and p.dim() == 2]
        if kind == "GroupedLinear":
            gemm_weights = gemm_weights[:1]
        assert _flops(model.backward_dw) == sum(2 * 10 * w.numel() for w in gemm_weights)


def test_grouped_count_does_not_depend_on_routing():
    layer = splitgrad.GroupedLinear(4, 8, 6, device="cpu")
    x = torch.randn(12, 8)
    counts = {_flops(lambda s=s: layer(x, s)) for s in ([3, 3, 3, 3], [12, 0, 0, 0], [0, 1, 0, 11])}
    assert counts == {2 * 12 * 8 * 6}
    assert _flops(lambda: F.linear(x, layer.weight0)) == 2 * 12 * 8 * 6


@pytest.mark.parametrize("order", ["flop_counter_first", "splitgrad_first"])
def test_registered_in_either_import_order(order):
    imports = ["import torch.utils.flop_counter", "import splitgrad"]
    if order == "splitgrad_first":
        imports.reverse()
    script = "\n".join(imports) + textwrap.dedent("""
        import sys, torch
        from torch.utils.flop_counter import FlopCounterMode
        assert ("torch.utils.flop_counter" in sys.modules) or False
        layer = splitgrad.Linear(8, 6, device="cpu")
        with FlopCounterMode(display=False) as mode:
            layer(torch.randn(5, 8, requires_grad=True)).sum().backward()
        print(mode.get_total_flops())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == str(3 * 2 * 5 * 8 * 6)


def test_importing_splitgrad_does_not_import_the_flop_counter():
    script = "import sys, splitgrad; print('torch.utils.flop_counter' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
