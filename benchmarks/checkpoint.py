"""How long a training step waits for a checkpoint: ``fs.checkpoint.save`` vs ``async_save``.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint.py [--layers 8 --width 256]

The main job's language model, sharded on 2 ranks, with AdamW-like state (two moments placed
like the parameters, a step count, the RNG states): the tree a resume needs. Each round takes a
synchronous save and an asynchronous one (interleaved, into a fresh directory under ``--dir``,
``keep=2``), and reports medians of: the time the caller is blocked (for ``async_save``: the
copy of every shard aside, planning, and the start of the background writer); the time until
the checkpoint is committed (``async_save``: ``wait()`` right after one training step); and the
training step that runs while the background save writes, against a step with no save. Every
file is fsynced, so the numbers depend on the disk. Nothing is asserted: numbers for people.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from _data import batch  # synthetic tokens
from train_lm import LM  # the main job's model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    torch.manual_seed(0)
    vocab, length = 61, 16
    model = LM(vocab, args.width, 4, args.layers, length)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh)
    model.to("meta")
    loss_fn = lambda p, tokens: F.cross_entropy(
        fs.functional_call(model, (fs.unshard(p), buffers), (tokens,))[:, :-1].flatten(0, 1),
        tokens[:, 1:].flatten(),
    )
    moments = [{k: torch.zeros_like(v) for k, v in sharded.items()} for _ in range(2)]

    def step(i: int) -> float:
        t0 = time.perf_counter()
        _, grads = fs.value_and_grad(loss_fn)(sharded, batch(i, rank, 8, length, vocab))
        with torch.no_grad():  # in place, as an optimizer does: the async save has its copy
            for k, p in sharded.items():
                moments[0][k].mul_(0.9).add_(grads[k])
                moments[1][k].mul_(0.95).add_(grads[k] * grads[k])
                p.sub_(1e-3 * moments[0][k] / (moments[1][k].sqrt() + 1e-8))
        return time.perf_counter() - t0

    def tree(i: int) -> dict:
        count = torch.tensor(i)
        return {
            "params": sharded,
            "opt": (count, *moments),
            "step": i,
            "rng": fs.checkpoint.rng_state(),
        }

    root = [args.dir or (tempfile.mkdtemp(prefix="funcshard-bench-") if rank == 0 else None)]
    dist.broadcast_object_list(root)
    mb = sum(v.to_local().numel() * 4 for v in sharded.values()) * 3 / 2**20
    rows: dict[str, list[float]] = {k: [] for k in ("step", "sync", "async", "commit", "during")}
    step(0)  # warm up
    for i in range(args.rounds):
        rows["step"].append(step(1 + 3 * i))
        dist.barrier()
        t0 = time.perf_counter()
        fs.checkpoint.save(f"{root[0]}/sync_{i}", tree(i), keep=2)
        rows["sync"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        saving = fs.checkpoint.async_save(f"{root[0]}/async_{i}", tree(i), keep=2)
        rows["async"].append(time.perf_counter() - t0)
        rows["during"].append(step(2 + 3 * i))
        saving.wait()
        rows["commit"].append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
        print(f"state per rank: {mb:.1f} MiB (params + 2 moments), {args.rounds} rounds, medians")
        print(f"training step, no save            {med['step']:7.1f} ms")
        print(f"save: step blocked                {med['sync']:7.1f} ms")
        print(
            f"async_save: step blocked          {med['async']:7.1f} ms  "
            f"({med['async'] / med['sync']:.2f} x save)"
        )
        print(f"async_save: committed after       {med['commit']:7.1f} ms (one step, then wait)")
        print(f"training step during async write  {med['during']:7.1f} ms")
    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(root[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
