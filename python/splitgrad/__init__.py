"""splitgrad: linear layers whose deferred weight gradients equal plain autograd's.

``import splitgrad as te`` runs code written for the delayed-wgrad API (``delay_wgrad_compute=True``,
``backward_dw()``, ``fuse_wgrad_accumulation``) of transformer_engine.pytorch's Linear,
LayerNormLinear and LayerNormMLP.
"""

import os as _os

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _C  # registers torch.ops.splitgrad.* and the deferred-wgrad store
from ._deferred import (
    backward_dw_all,
    get_pending_work_policy,
    grad_ready_pass,
    layers_with_pending_wgrads,
    pending_wgrads,
    register_grad_ready_hook,
    set_pending_work_policy,
)
from ._errors import ArgumentError, DTypeError, MainGradError, PendingWgradError, PendingWgradWarning
from ._grouped_linear import GroupedLinear
from ._linear import Linear, name_layers
from ._layernorm import LayerNormLinear, LayerNormMLP
from . import distributed  # splitgrad.distributed.GradReducer
from . import _flops

_flops.install()  # FlopCounterMode counts splitgrad's GEMMs as nn.Linear's


def __getattr__(name):
    # splitgrad.pipelining and splitgrad.schedule_sim import torch.distributed.pipelining, which is
    # heavy: load them on first use.
    if name in ("pipelining", "schedule_sim"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'splitgrad' has no attribute {name!r}")


__version__ = "0.1.0"

# The folder holding splitgrad's CMake package (splitgradConfig.cmake; the headers and libsplitgrad
# lie next to it in this package), for a C++ program: add it to CMAKE_PREFIX_PATH, next to
# torch.utils.cmake_prefix_path, and find_package(splitgrad).
cmake_prefix_path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "share", "cmake")

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "backward_dw_all",
    "pending_wgrads",
    "layers_with_pending_wgrads",
    "register_grad_ready_hook",
    "grad_ready_pass",
    "set_pending_work_policy",
    "get_pending_work_policy",
    "name_layers",
    "distributed",
    "pipelining",
    "schedule_sim",
    "ArgumentError",
    "DTypeError",
    "MainGradError",
    "PendingWgradError",
    "PendingWgradWarning",
]
