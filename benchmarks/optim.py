"""fs.optim vs torch.optim on the same DTensor shards: peak memory and time of one optimizer step
(gradient clipping + AdamW), reported as ratios to ``torch.optim.AdamW``.

    torchrun --standalone --nproc-per-node 2 benchmarks/optim.py [--layers 8 --width 256]

The parameters are the main job's model sharded with ``fs.shard`` (DTensor shards, as FSDP2's
sharded parameters are); the gradients come from one ``fs.value_and_grad`` step and are copied
before each measured step, outside the measurement. The reference is what an FSDP2 user runs:
``clip_grad_norm_`` + ``torch.optim.AdamW`` on the DTensor parameters, with torch's default
kernel choice (``foreach=None``: a loop over tensors on CPU, foreach kernels on CUDA) and with
``foreach=True``. The first step (which allocates torch.optim's lazy state) is not measured.
Peak memory is the allocator's high-water mark above the step's start, in the calling thread;
"state" is what the optimizer keeps between steps. Ratios compare with the torch.optim variant
of the same ``foreach``. Nothing here is asserted: the numbers are for people.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from _data import batch  # synthetic tokens
from train_lm import LM  # the main job's model

LR, WD, CLIP = 1e-3, 0.1, 1.0


def copy(tree):
    return {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in tree.items()}


def state_bytes(tensors) -> int:
    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


def torch_variant(sharded, foreach):
    params = copy(sharded)
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=WD, foreach=foreach)

    def run(grads):
        fs.optim.set_grads(params, grads)
        torch.nn.utils.clip_grad_norm_(params.values(), CLIP, foreach=foreach)
        opt.step()
        opt.zero_grad()

    return run, lambda: state_bytes(v for s in opt.state.values() for v in s.values())


def funcshard_variant(sharded, foreach, donated):
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(CLIP), fs.optim.adamw(LR, weight_decay=WD, foreach=foreach)
    )
    box = {"params": copy(sharded)}
    box["state"] = opt.init(box["params"])

    def run(grads):
        if donated:
            box["params"], box["state"] = fs.optim.step(opt, box["params"], grads, box["state"])
        else:
            updates, box["state"] = opt.update(grads, box["state"], box["params"])
            box["params"] = fs.optim.apply_updates(box["params"], updates)

    return run, lambda: state_bytes(optree.tree_leaves(box["state"]))


def main() -> None:
    warnings.filterwarnings("ignore", message=".*(returned a view tensor|Full backward hook).*")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    mesh = init_device_mesh("cpu", (int(os.environ.get("WORLD_SIZE", "2")),))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LM(args.vocab, args.width, 4, args.layers, 64)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh)
    model.to("meta")
    tokens = batch(0, rank, 4, 64, args.vocab)

    def loss_fn(p):
        logits = fs.functional_call(model, (fs.unshard(p), buffers), (tokens,))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    _, grads = fs.value_and_grad(loss_fn)(sharded)
    variants = {  # name: (run, state bytes, the torch.optim variant it is compared with)
        "torch.optim foreach=None": (*torch_variant(sharded, None), None),
        "fs.optim.step": (*funcshard_variant(sharded, None, True), "torch.optim foreach=None"),
        "fs.optim pure update": (
            *funcshard_variant(sharded, None, False),
            "torch.optim foreach=None",
        ),
        "torch.optim foreach=True": (*torch_variant(sharded, True), None),
        "fs.optim.step foreach=True": (
            *funcshard_variant(sharded, True, True),
            "torch.optim foreach=True",
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, int] = {}
    for i in range(args.steps + 1):
        for name, (run, _, _) in variants.items():
            g = copy(grads)
            dist.barrier()
            if i == 1:  # after the first step, which creates torch.optim's state
                peaks[name], _ = peak_bytes(lambda run=run, g=g: run(g), this_thread=True)
                continue
            t0 = time.perf_counter()
            run(g)
            if i > 1:
                times[name].append(time.perf_counter() - t0)
    param_bytes = sum(v.to_local().numel() * v.element_size() for v in sharded.values())
    if rank == 0:
        print(
            f"{args.layers} layers x {args.width} wide, {mesh.size()} ranks; parameters on rank 0: "
            f"{param_bytes / 2**20:.2f} MiB in {len(sharded)} tensors; clip + AdamW; "
            f"medians of {args.steps - 1} steps"
        )
        print(
            f"{'':28s} {'step ms':>8s} {'x torch':>8s} {'peak KiB':>9s} {'x torch':>8s} "
            f"{'state MiB':>10s}"
        )
        for name, (_, held, base) in variants.items():
            base = base or name
            ms, base_ms = (statistics.median(times[n]) * 1e3 for n in (name, base))
            print(
                f"{name:28s} {ms:8.1f} {ms / base_ms:8.2f} {peaks[name] / 1024:9.1f} "
                f"{peaks[name] / peaks[base]:8.3f} {held() / 2**20:10.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
