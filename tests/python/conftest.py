"""pytest fixtures shared by the whole suite. Helpers live in sg_helpers.py."""

import gc
import warnings

import pytest
import torch

import splitgrad


def _drain() -> None:
    """Runs (or, where their checks fail, drops) whatever deferred work is left."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while splitgrad.pending_wgrads():
            before = splitgrad.pending_wgrads()
            try:
                splitgrad.backward_dw_all()
            except RuntimeError:
                if splitgrad.pending_wgrads() >= before:
                    raise


@pytest.fixture(autouse=True)
def clean_deferred_state():
    """Every test starts from an empty deferred-wgrad store, the default policy and a fixed seed,
    and must not leave deferred work behind (that would be a forgotten gradient)."""
    gc.collect()  # layers of earlier tests that are garbage release their work
    _drain()  # only after a failed test: that test has been reported already
    splitgrad.set_pending_work_policy("warn")
    torch.manual_seed(0)
    yield
    splitgrad.set_pending_work_policy("warn")
    left = splitgrad.pending_wgrads()
    if left:
        layers = splitgrad.layers_with_pending_wgrads()
        _drain()
        pytest.fail(f"the test left {left} deferred wgrad item(s) pending, for layers {layers}")
