"""Muon on sharded matrices: one owner per matrix (``fs.optim.muon``) against gathering every
matrix on every rank, with the bytes each moves, the lower bound, and AdamW's step for scale.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/muon.py
    torchrun --standalone --nproc-per-node 8 benchmarks/muon.py --device cuda   # NCCL, one GPU each

The matrices are the hidden ones of the main job's model (per block: ``qkv`` [3w, w], ``proj``
[w, w], ``mlp.0`` [4w, w], ``mlp.2`` [w, 4w]), sharded on dim 0 with ``fs.shard``; the gradients
are random (the optimizer's cost does not depend on their values). Variants, each a donated step
on the same shards:

- ``owner``: ``fs.optim.step`` with ``fs.optim.muon`` (two all-to-alls, Newton-Schulz once per
  matrix, on its owner).
- ``gather everywhere``: the same arithmetic with each matrix's update gathered on every rank
  (``DTensor.full_tensor()``, one all-gather per matrix), Newton-Schulz on every rank, each rank
  keeping its rows: what a Muon written for one process does on DTensor shards.
- ``adamw``: ``fs.optim.step`` with ``fs.optim.adamw``, for scale.
- ``NS only``: Newton-Schulz of every matrix on one rank, no communication: the compute that
  ``gather everywhere`` repeats on every rank and ``owner`` shares out.

Bytes are per step, counted from the shards' sizes (bfloat16 blocks, both directions): the
traffic over all ranks and the most any one rank receives. The lower bound is what any scheme
that orthogonalises each matrix once must move: every element the owner does not hold, there and
back, with the best owner. Both implementations are checked to give the same parameters. Timings
alternate between the variants (medians); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

import funcshard as fs
from funcshard._trees._spec import chunk
from funcshard.optim import _whole

LR, WD, MOMENTUM, NS = 0.02, 0.1, 0.95, ((3.4445, -4.775, 2.0315), 5, 1e-7)


def shapes(width: int, layers: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        w, name = width, f"blocks.{i}."
        out |= {name + "qkv.weight": (3 * w, w), name + "proj.weight": (w, w),
                name + "mlp.0.weight": (4 * w, w), name + "mlp.2.weight": (w, 4 * w)}  # fmt: skip
    return out


def gather_everywhere_step(params, grads, bufs) -> None:
    """torch.optim.Muon's arithmetic, each matrix gathered on every rank (in place)."""
    for k, p in params.items():
        g, buf = grads[k].to_local(), bufs[k].to_local()
        buf.lerp_(g, 1 - MOMENTUM)
        u = g.lerp(buf, MOMENTUM).bfloat16()
        spec = fs.ShardSpec.of(p)
        whole = DTensor.from_local(
            u, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        ).full_tensor()
        o = _zeropower_via_newtonschulz(whole, *NS)
        start, rows = spec.local_offset()[0], u.shape[0]
        local = p.to_local()
        local.mul_(1 - LR * WD)
        local.add_(o[start : start + rows], alpha=-_adjust_lr(LR, None, p.shape))


def traffic(params) -> dict[str, float]:
    """Bytes per step (bfloat16): owner, gather everywhere, lower bound; totals and max per rank."""
    world = dist.get_world_size()
    layouts = tuple(_whole.Layout.of(fs.ShardSpec.of(p)) for p in params.values())
    plans = [_whole.plan(layouts, r, world) for r in range(world)]
    received = [0] * world  # elements each rank receives, both directions
    for r, p in enumerate(plans):
        received[r] += p.sent_numel  # its blocks of the results come back
        for _, _, contributors in p.owned:
            received[r] += sum(b[2] * b[3] for src, b in contributors if src != r)
    rows = [[chunk(m, world, r)[0] * n for r in range(world)] for m, n in
            (p.shape for p in params.values())]  # fmt: skip
    gathered = [sum(sum(b) - b[r] for b in rows) for r in range(world)]
    bound = sum(2 * (sum(b) - max(b)) for b in rows)
    mib = 2 / 2**20
    return {
        "owner_total_mib": sum(received) * mib,
        "owner_max_rank_mib": max(received) * mib,
        "gather_total_mib": sum(gathered) * mib,
        "gather_max_rank_mib": max(gathered) * mib,
        "lower_bound_total_mib": bound * mib,
    }


def setup(width: int, layers: int):
    """The command line (``--width``, ``--layers``, ``--rounds``, ``--device``, ``--out``) and
    the process group: NCCL (and gloo for CPU tensors) with ``--device cuda``, else gloo.

    Returns ``(args, mesh, device)``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return args, mesh, device


def main() -> None:
    args, mesh, device = setup(width=256, layers=4)
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = {
        k: torch.randn(s, device=device) * 0.02 for k, s in shapes(args.width, args.layers).items()
    }
    grads_full = {k: torch.randn_like(v) for k, v in full.items()}
    grads = fs.shard(grads_full, mesh)

    def fresh():
        return {k: v.detach().clone() for k, v in fs.shard(full, mesh).items()}

    muon, adamw = fs.optim.muon(LR), fs.optim.adamw(1e-3, weight_decay=WD)
    box = {"owner": fresh(), "gather": fresh(), "adamw": fresh()}
    states = {"owner": muon.init(box["owner"]), "adamw": adamw.init(box["adamw"])}
    bufs = {k: torch.zeros_like(v) for k, v in box["gather"].items()}
    matrices = [v.bfloat16() for v in grads_full.values()]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    variants = {
        "owner": lambda: fs.optim.step(muon, box["owner"], grads, states["owner"]),
        "gather everywhere": lambda: gather_everywhere_step(box["gather"], grads, bufs),
        "adamw": lambda: fs.optim.step(adamw, box["adamw"], grads, states["adamw"]),
        "NS only": lambda: [_zeropower_via_newtonschulz(m.clone(), *NS) for m in matrices],
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(args.rounds + 1):
        for name, run in variants.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    same = all(torch.equal(box["owner"][k].to_local(), box["gather"][k].to_local()) for k in full)
    result = {
        "world": world,
        "device": torch.cuda.get_device_name() if cuda else "cpu (gloo)",
        "matrices": len(full),
        "parameters_mib": sum(v.numel() * 4 for v in full.values()) / 2**20,
        "same_parameters": same,
        "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        **traffic(box["owner"]),
    }
    if rank == 0:
        print(json.dumps(result, indent=1))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"muon-{world}ranks{'-cuda' if cuda else ''}.json"
        (Path(args.out) / name).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
