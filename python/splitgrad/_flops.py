"""FLOP formulas of splitgrad's GEMM ops for torch.utils.flop_counter.FlopCounterMode, which counts
nn.Linear's: each op is 2·rows·in·out multiply-adds, whatever the routing of a grouped op (every
row goes through one expert). The elementwise parts (bias, activation) are not counted, as
PyTorch counts none. FlopCounterMode sees the ops below autograd, so a deferred wgrad is counted
where backward_dw() runs it.

torch.utils.flop_counter is heavy to import (it loads Triton where present), so the formulas are
registered when something imports it, not when splitgrad is imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import sys

import torch

_FLOP_COUNTER = "torch.utils.flop_counter"


def _rows(t: torch.Tensor) -> int:
    return math.prod(t.shape[:-1])


def _linear_product(tokens, weight, *args, out_val=None, **kwargs) -> int:
    """fprop (x, W) and dgrad (dy, W): the weight [out, in] gives the sizes."""
    return 2 * _rows(tokens) * weight.numel()


def _linear_wgrad(grad_output, input, *args, out_val=None, **kwargs) -> int:
    return 2 * _rows(grad_output) * grad_output.shape[-1] * input.shape[-1]


def _linear_wgrad_accumulate(grad_output, input, weight_grad, bias_grad, out_val=None) -> int:
    # weight_grad None: the bias gradient alone (a sum, not counted)
    return 0 if weight_grad is None else _linear_wgrad(grad_output, input)


def _grouped_product(tokens, m_splits, weights, *args, out_val=None, **kwargs) -> int:
    return 2 * _rows(tokens) * weights[0].numel() if weights else 0


def _grouped_wgrad_accumulate(grad_output, input, m_splits, weight_grads, bias_grads, out_val=None) -> int:
    """Only the experts with a weight target compute a product: their rows, read from CPU splits;
    device or traced splits are not read (no synchronisation), each expert then counted at the
    average rows."""
    targets = [t is not None for t in weight_grads]
    if not any(targets):
        return 0
    per_row = 2 * grad_output.shape[-1] * input.shape[-1]
    if all(targets):
        return per_row * _rows(grad_output)
    if m_splits.device.type == "cpu" and not isinstance(m_splits, torch._subclasses.FakeTensor):
        return per_row * sum(rows for rows, wanted in zip(m_splits.tolist(), targets) if wanted)
    return per_row * _rows(grad_output) * sum(targets) // len(targets)


def _register(flop_counter) -> None:
    ops = torch.ops.splitgrad
    formulas = {
        ops.linear_fprop: _linear_product,
        ops.linear_dgrad: _linear_product,
        ops.linear_wgrad: _linear_wgrad,
        ops.linear_wgrad_accumulate_: _linear_wgrad_accumulate,
        ops.grouped_linear_fprop: _grouped_product,
        ops.grouped_linear_dgrad: _grouped_product,
        ops.grouped_linear_wgrad: _linear_wgrad,
        ops.grouped_linear_wgrad_accumulate_: _grouped_wgrad_accumulate,
    }
    for op, formula in formulas.items():
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op, get_raw=True)(formula)


class _RegisterWhenImported(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs _register() right after torch.utils.flop_counter is first imported."""

    def __init__(self) -> None:
        self._finding = False
        self._loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != _FLOP_COUNTER or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders' spec
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _uninstall()
        _register(module)


_hook = _RegisterWhenImported()


def _uninstall() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def install() -> None:
    if _FLOP_COUNTER in sys.modules:
        _register(sys.modules[_FLOP_COUNTER])
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
