"""Putting an existing model of splitgrad layers under a zero-bubble pipeline schedule.

    torchrun --nproc-per-node 2 examples/pipeline_zero_bubble.py      # gloo, on the CPU

Three changes turn a model of ``splitgrad.Linear(..., delay_wgrad_compute=True)`` layers into a
zero-bubble pipeline: cut it into one module per stage, wrap each in
``splitgrad.pipelining.PipelineStage`` (torch's PipelineStage whose W step is the layers'
deferred wgrad), and hand the stages to one of torch's schedules. The B steps then compute only
input gradients and the W steps the weight gradients the schedule uses to fill its bubbles.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

import splitgrad
from splitgrad.pipelining import PipelineStage

WIDTH, CLASSES, MICRO_BATCHES = 64, 10, 8


def existing_model() -> nn.Sequential:
    """Four blocks and a classifier, every projection a delayed splitgrad layer."""
    torch.manual_seed(0)  # the same initial weights on every rank

    def block():
        return nn.Sequential(splitgrad.Linear(WIDTH, WIDTH, device="cpu", delay_wgrad_compute=True), nn.GELU())

    head = splitgrad.Linear(WIDTH, CLASSES, device="cpu", delay_wgrad_compute=True)
    return nn.Sequential(*(block() for _ in range(4)), head)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. Cut the model: rank r keeps the r-th slice of its top-level modules.
    parts = list(existing_model().children())
    bounds = [len(parts) * r // world for r in range(world + 1)]
    stage_module = nn.Sequential(*parts[bounds[rank] : bounds[rank + 1]])
    splitgrad.name_layers(stage_module, prefix=f"stage{rank}")

    # 2. Wrap it: torch's PipelineStage, with splitgrad's deferred wgrad as its W step.
    stage = PipelineStage(stage_module, stage_index=rank, num_stages=world, device="cpu")

    # 3. Schedule it: any of torch's schedules (this one has W actions that fill the bubbles).
    schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=MICRO_BATCHES, loss_fn=F.cross_entropy)

    optimizer = torch.optim.Adam(stage_module.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(WIDTH, CLASSES, generator=generator)
    for step in range(30):
        x = torch.randn(MICRO_BATCHES * 16, WIDTH, generator=generator)
        y = (x @ teacher).argmax(dim=1)  # every rank draws the same batch
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        if losses and step % 10 == 9:
            print(f"step {step + 1}: loss {torch.stack(losses).mean().item():.4f}")
    assert splitgrad.pending_wgrads() == 0, "every deferred wgrad ran in a W step"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
