"""Run in a fresh process by test_cuda_determinism.py: prints one JSON line.

  python cuda_numerics.py compare [--deterministic]
      delayed vs immediate gradients for every dtype x bias x fusion x 1-3 micro-batches x shape:
      which parameters are bit-identical, and a digest of every delayed gradient
  python cuda_numerics.py train [--deterministic]
      a few training steps of a small tied model; a digest of the parameters after each step
"""

import hashlib
import itertools
import json
import sys

import torch

import splitgrad

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = [(32, 128, 8), (32, 128, 16), (384, 256, 512)]  # (in, out, tokens per micro-batch)


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def grad_of(p):
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def make_pair(in_features, out_features, dtype, bias, fused):
    """Two-layer models, delayed and immediate, with the same weights."""
    models = []
    for delay in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            splitgrad.Linear(in_features, out_features, bias=bias, params_dtype=dtype, device="cuda",
                             delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused),
            torch.nn.GELU(),
            splitgrad.Linear(out_features, in_features, bias=bias, params_dtype=dtype, device="cuda",
                             delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused),
        )
        if fused:
            for p in model.parameters():
                p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
        models.append(model)
    return models


def compare():
    out = {}
    for (dname, dtype), bias, fused, micro_batches, (i, o, tokens) in itertools.product(
            DTYPES.items(), (False, True), (False, True), (1, 2, 3), SHAPES):
        delayed, immediate = make_pair(i, o, dtype, bias, fused)
        generator = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(micro_batches):
            x = torch.randn(tokens, i, device="cuda", dtype=dtype, generator=generator)
            dy = torch.randn(tokens, i, device="cuda", dtype=dtype, generator=generator)
            for model in (delayed, immediate):
                model(x).backward(dy)
        splitgrad.backward_dw_all()
        names = [n for n, _ in delayed.named_parameters()]
        identical = {
            n: bool(torch.equal(grad_of(a), grad_of(b)))
            for n, a, b in zip(names, delayed.parameters(), immediate.parameters())
        }
        key = f"{dname}|bias={bias}|fused={fused}|mb={micro_batches}|{i}x{o}x{tokens}"
        out[key] = {"identical": identical, "digest": digest(grad_of(p) for p in delayed.parameters())}
    return out


def train():
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layers = [splitgrad.Linear(256, 256, params_dtype=dtype, device="cuda", delay_wgrad_compute=True,
                               fuse_wgrad_accumulation=fused) for fused in (True, False, True)]
    layers[2].weight = layers[0].weight  # tied
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
    for p in params:
        if layers[0].fuse_wgrad_accumulation and (p is layers[0].weight or p is layers[0].bias or p is layers[2].bias):
            p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
    generator = torch.Generator(device="cuda").manual_seed(3)
    digests = []
    for _ in range(4):
        for _ in range(3):  # micro-batches
            x = torch.randn(128, 256, device="cuda", dtype=dtype, generator=generator)
            h = x
            for layer in layers:
                h = torch.nn.functional.gelu(layer(h))
            h.float().square().mean().backward()
        for layer in reversed(layers):
            for _ in range(3):
                layer.backward_dw()
        with torch.no_grad():
            for p in params:
                g = grad_of(p)
                p.sub_(0.01 * g.to(p.dtype))
                g.zero_()
        digests.append(digest(params))
    return digests


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    if "--deterministic" in sys.argv:
        torch.use_deterministic_algorithms(True)
    result = compare() if sys.argv[1] == "compare" else train()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
