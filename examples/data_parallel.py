"""Data-parallel training with deferred weight gradients: DDP-style all-reduce or FSDP2 sharding.

    torchrun --nproc-per-node 2 examples/data_parallel.py --mode ddp     # splitgrad.distributed.GradReducer
    torchrun --nproc-per-node 2 examples/data_parallel.py --mode fsdp    # splitgrad.distributed.fully_shard

Every rank trains the same model on its own data; each step runs the backward (input gradients
only for the delayed layers), then the deferred weight gradients layer by layer, last layer first.
The reduction of a parameter (DDP: its bucket's all-reduce; FSDP: its unit's reduce-scatter)
starts as soon as its last contribution has landed, so it overlaps the backward_dw() calls still
to come. Both print how many collectives started during backward_dw() rather than after it.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
import splitgrad.distributed as sgd

WIDTH, CLASSES = 64, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = splitgrad.Linear(WIDTH, 4 * WIDTH, device="cpu", delay_wgrad_compute=True)
        self.fc2 = splitgrad.Linear(4 * WIDTH, WIDTH, device="cpu", delay_wgrad_compute=True)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = splitgrad.Linear(WIDTH, CLASSES, device="cpu", delay_wgrad_compute=True)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = Model()
    splitgrad.name_layers(model)
    delayed = [m for m in model.modules() if isinstance(m, splitgrad.Linear)]
    if args.mode == "ddp":
        reducer = sgd.GradReducer(model, bucket_cap_mb=0.05)  # small buckets: several collectives
        log = reducer.launch_log
    else:
        for block in model.blocks:  # FSDP2, bottom-up: each block a unit, then the root
            sgd.fully_shard(block)
        sgd.fully_shard(model)
        reducer, log = None, sgd.fsdp_reduction_log
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    teacher = torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(32, WIDTH, generator=generator)
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
        log.clear()
        loss.backward()  # input gradients; regular parameters' gradients
        started_in_backward = len(log)
        for layer in reversed(delayed):  # the deferred weight gradients, last layer first
            layer.backward_dw()  # reductions start here, as each parameter's last part lands
        if reducer is not None:
            reducer.finish()  # wait; .grad holds the average over the ranks
        optimizer.step()  # (FSDP: waits for the reduce-scatters first)
        optimizer.zero_grad()
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1}: loss {loss.item():.4f}; collectives started during backward_dw(): "
                  f"{len(log) - started_in_backward} of {len(log)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
