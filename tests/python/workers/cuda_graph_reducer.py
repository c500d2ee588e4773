"""Run in a fresh process by test_cuda_graphs.py: a GradReducer step over NCCL (one rank, one GPU)
captured in a CUDA graph and replayed, against the same steps run eagerly. Prints one JSON line."""

import json
import socket

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.distributed import GradReducer

WIDTH, TOKENS, STEPS = 256, 512, 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        splitgrad.Linear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=True,
                         fuse_wgrad_accumulation=True) for _ in range(3))
    layers[2].weight = layers[0].weight
    for p in {id(p): p for p in layers.parameters()}.values():
        p.main_grad = torch.zeros(p.shape, device="cuda")
    return layers


def step(layers, reducer, x):
    h = x
    for layer in layers:
        h = torch.nn.functional.gelu(layer(h))
    h.float().square().mean().backward()
    for layer in reversed(layers):
        layer.backward_dw()
    reducer.finish()


def main_grads(layers):
    return [p.main_grad.clone() for p in {id(p): p for p in layers.parameters()}.values()]


def main():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    generator = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16, generator=generator)
              for _ in range(STEPS)]

    eager = make_model()
    eager_reducer = GradReducer(eager, bucket_cap_mb=0.1)
    for x in inputs:
        step(eager, eager_reducer, x)
    expected = main_grads(eager)

    graphed = make_model()
    reducer = GradReducer(graphed, bucket_cap_mb=0.1)
    static_x = torch.zeros_like(inputs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: NCCL's communicator, cuBLASLt's plans
        for _ in range(2):
            step(graphed, reducer, static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p in {id(p): p for p in graphed.parameters()}.values():
        p.main_grad.zero_()
    before = len(reducer.launch_log)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, reducer, static_x)
    launches_at_capture = len(reducer.launch_log) - before
    for x in inputs:
        static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    got = main_grads(graphed)
    identical = all(torch.equal(a, b) for a, b in zip(got, expected))
    print(json.dumps({
        "launches_at_capture": launches_at_capture,
        "launches_during_replays": len(reducer.launch_log) - before - launches_at_capture,
        "buckets": len(reducer.buckets),
        "identical": identical,
        "max_difference": max(float((a - b).abs().max()) for a, b in zip(got, expected)),
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
