"""Optimizer state and master weights offloaded to CPU memory: ``fs.optim.offload`` against the
same optimizer on the device and against FSDP2 with ``CPUOffloadPolicy``, one training step each
(forward, backward, clipping, AdamW), peak and resident device memory.

    torchrun --standalone --nproc-per-node 1 benchmarks/offload.py --device cuda [--width 1024]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/offload.py  # CPU check

On CUDA the three variants run; on CPU (where "device" and host memory are the same) only the
two funcshard ones, as a check that the script works: CPU numbers say nothing about offloading.
The model is the main job's transformer; timings alternate between the variants (medians);
nothing is asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import funcshard as fs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from muon import setup  # the command line and the process group

from _data import batch  # synthetic tokens
from train_lm import LM, Block  # the main job's model

LR, WD, CLIP, VOCAB, CONTEXT = 1e-3, 0.1, 1.0, 256, 128


def funcshard_variant(model_fn, mesh, device, offloaded: bool):
    model = model_fn()
    params, buffers = fs.extract(model)
    sharded = fs.shard({k: v.to(device) for k, v in params.items()}, mesh)
    model.to("meta")
    adamw = fs.optim.adamw(LR, weight_decay=WD)
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(CLIP), fs.optim.offload(adamw) if offloaded else adamw
    )
    box = {"params": sharded, "state": opt.init(sharded)}

    def loss_fn(p, tokens):
        logits = fs.functional_call(model, (fs.unshard(p), buffers), (tokens,))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    def step(tokens):
        _, grads = fs.value_and_grad(loss_fn)(box["params"], tokens)
        box["params"], box["state"] = fs.optim.step(opt, box["params"], grads, box["state"])

    return step


def fsdp2_offload_variant(model_fn, mesh, device):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = model_fn()
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

    def step(tokens):
        logits = model(tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    args, mesh, device = setup(width=512, layers=8)
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()

    def model_fn():
        torch.manual_seed(0)
        return LM(VOCAB, args.width, 8, args.layers, CONTEXT).to(device)

    variants = {
        "fs.optim on the device": funcshard_variant(model_fn, mesh, device, False),
        "fs.optim.offload": funcshard_variant(model_fn, mesh, device, True),
    }
    if cuda:
        variants["FSDP2 + CPUOffloadPolicy"] = fsdp2_offload_variant(model_fn, mesh, device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    peak, resident = {}, {}
    for i in range(args.rounds + 1):
        for name, step in variants.items():
            tokens = batch(i, rank, 8, CONTEXT, VOCAB).to(device)
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            step(tokens)
            if cuda:
                torch.cuda.synchronize()
                peak[name] = torch.cuda.max_memory_allocated() / 2**20
                resident[name] = before / 2**20
            if i:  # the first round warms up (and creates torch.optim's state)
                times[name].append(time.perf_counter() - t0)
    result = {
        "world": world,
        "device": torch.cuda.get_device_name()
        if cuda
        else "cpu (gloo): a check, not a measurement",
        "width": args.width,
        "layers": args.layers,
        "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "peak_device_mib": peak,
        "resident_device_mib_between_steps": resident,
    }
    if rank == 0:
        print(json.dumps(result, indent=1))
        if cuda:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"offload-{world}ranks-cuda.json").write_text(
                json.dumps(result, indent=1) + "\n"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
