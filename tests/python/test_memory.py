"""SPEC §3: stashed activations are freed as soon as their deferred work has run, when their item
is dropped, and when their layer is deleted. Checked with weak references to the tensors' storage
(the store keeps detached views of activations with autograd history: the values, not the
history), which expire when the last tensor on them goes, and to the caller's tensor objects."""

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import splitgrad

D = 8


class Stack(nn.Module):
    """Delayed layers; remembers weak references to the activations each layer stashes."""

    def __init__(self, n=3, **kw):
        super().__init__()
        self.layers = nn.ModuleList(
            splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True, **kw) for _ in range(n))
        self.stashed = []

    def forward(self, x):
        for layer in self.layers:
            self.stashed.append(StorageWeakRef(x.untyped_storage()))
            x = torch.tanh(layer(x))
        return x


def forward_backward(model, batch=4):
    """One forward/backward with no strong reference to any activation or gradient left behind;
    returns a weak reference to the storage of the grad_output the last layer receives."""
    x = torch.randn(batch, D)
    gy = torch.randn(batch, D)
    model(x).backward(gy)
    return StorageWeakRef(gy.untyped_storage())


def alive(refs):
    gc.collect()
    return [not r.expired() for r in refs]


def test_freed_after_backward_dw():
    model = Stack()
    forward_backward(model)
    assert alive(model.stashed) == [True, True, True]  # held by the store only
    model.layers[1].backward_dw()
    assert alive(model.stashed) == [True, False, True]
    model.layers[0].backward_dw()
    model.layers[2].backward_dw()
    assert alive(model.stashed) == [False, False, False]


def test_grad_output_freed_after_backward_dw():
    layer = splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True)
    x = torch.randn(3, D)
    gy = torch.randn(3, D)
    layer(x).backward(gy)  # gy reaches the layer's backward as its grad_output
    ref_gy = StorageWeakRef(gy.untyped_storage())
    del gy
    assert alive([ref_gy]) == [True]
    layer.backward_dw()
    assert alive([ref_gy]) == [False]


def test_freed_after_backward_dw_all_over_many_steps():
    """Many micro-batches: nothing accumulates in the store once their work has run."""
    model = Stack(n=2)
    grads = []
    for _ in range(4):
        grads.append(forward_backward(model))
    assert splitgrad.pending_wgrads() == 8
    splitgrad.backward_dw_all()
    assert splitgrad.pending_wgrads() == 0
    assert not any(alive(model.stashed))
    assert not any(alive(grads))


def test_freed_when_item_is_dropped():
    """An item dropped by the in-place check frees its tensors too."""
    model = Stack(n=1)
    x = torch.randn(3, D)
    model(x).backward(torch.randn(3, D))
    x.add_(1.0)
    del x
    with pytest.raises(RuntimeError, match="modified in place"):
        model.layers[0].backward_dw()
    assert alive(model.stashed) == [False]


@pytest.mark.parametrize("what", ["layer", "model"])
def test_freed_when_layer_or_model_is_deleted(what):
    model = Stack()
    forward_backward(model)
    stashed = model.stashed
    assert splitgrad.pending_wgrads() == 3
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if what == "layer":
            del model.layers[1]
        else:
            del model
        gc.collect()
    deleted = 1 if what == "layer" else 3
    assert sum(issubclass(w.category, splitgrad.PendingWgradWarning) for w in record) == deleted
    assert splitgrad.pending_wgrads() == 3 - deleted
    if what == "layer":
        assert alive(stashed) == [True, False, True]
        splitgrad.backward_dw_all()
    assert alive(stashed) == [False, False, False]


@pytest.mark.parametrize("release", ["backward_dw", "delete"])
def test_the_callers_tensors_live_until_their_work_runs(release):
    """Tensors without autograd history are stashed as they are (as autograd saves an input): a
    weak reference to the caller's input and grad_output lives while the work is pending and
    expires once it has run or its layer is deleted."""
    layer = splitgrad.Linear(D, D, device="cpu", delay_wgrad_compute=True)
    x, gy = torch.randn(3, D), torch.randn(3, D)
    refs = [weakref.ref(x), weakref.ref(gy)]
    layer(x).backward(gy)
    del x, gy
    gc.collect()
    assert [r() is not None for r in refs] == [True, True]
    if release == "backward_dw":
        layer.backward_dw()
    else:
        with pytest.warns(splitgrad.PendingWgradWarning):
            del layer
            gc.collect()
    gc.collect()
    assert [r() is None for r in refs] == [True, True]
