"""The Transformer Engine bug report's reproducer (shared/reference/tied-weights-delayed-wgrad-report.txt),
verbatim but for ``import splitgrad as te`` and the device: two tied delayed layers must give the
shared weight the same gradient as two tied regular layers."""

import pytest
import torch
from torch import nn

import splitgrad as te
from sg_helpers import DEVICES, assert_grads_match, to_reference


def make_model(delay_wgrad_compute: bool, device: str) -> nn.Sequential:
    model = nn.Sequential(
        te.Linear(
            16, 16, bias=False, params_dtype=torch.bfloat16, device=device,
            delay_wgrad_compute=delay_wgrad_compute,
            fuse_wgrad_accumulation=False,
        ),
        te.Linear(
            16, 16, bias=False, params_dtype=torch.bfloat16, device=device,
            delay_wgrad_compute=delay_wgrad_compute,
            fuse_wgrad_accumulation=False,
        ),
    )
    model[1].weight = model[0].weight
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_report_reproducer(device):
    torch.manual_seed(9)
    delayed = make_model(True, device)
    regular = make_model(False, device)
    regular.load_state_dict(delayed.state_dict())

    x = torch.randn(2, 16, device=device, dtype=torch.bfloat16, requires_grad=True)

    delayed(x).float().sum().backward()
    regular(x).float().sum().backward()

    delayed[0].backward_dw()
    delayed[1].backward_dw()

    torch.testing.assert_close(delayed[0].weight.grad, regular[0].weight.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_report_reproducer_against_plain_autograd(device):
    """The same model, compared with plain PyTorch autograd (nn.Linear) rather than with
    splitgrad's own regular path, in float32 (bit for bit on the CPU) and bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(9)
        delayed = make_model(True, device).to(dtype)
        reference = to_reference(delayed)
        high = to_reference(delayed, torch.float64)
        x = torch.randn(2, 16, device=device, dtype=dtype)

        delayed(x).float().sum().backward()
        reference(x).float().sum().backward()
        high(x.double()).sum().backward()
        delayed[0].backward_dw()
        delayed[1].backward_dw()

        assert_grads_match(delayed, reference, exact=(dtype == torch.float32 and device == "cpu"),
                           high_precision=high)
