"""DTensor trees straight into torch.func vs the conversion form (fs.to_local / fs.from_local):
time per call, interleaved, medians, as a ratio (direct / conversion). Nothing is asserted.

    torchrun --standalone --nproc-per-node 2 benchmarks/func.py [--layers 8 --width 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.func import grad, jvp, vmap

import funcshard as fs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh)
    tangent = fs.shard({k: torch.ones_like(v) for k, v in params.items()}, mesh)
    x = torch.randn(16, args.width)
    loss = lambda p, x: fs.functional_call(model, fs.unshard(p), (x,)).square().mean()
    per_sample = vmap(grad(lambda p, xi: loss(p, xi[None])), in_dims=(None, 0))
    cases = {
        "grad": (lambda p, t: grad(loss)(p, x), True),
        "vmap(grad)": (lambda p, t: per_sample(p, x[:4]), True),
        "jvp(grad)": (lambda p, t: jvp(lambda q: grad(loss)(q, x), (p,), (t,))[1], True),
    }
    report = {}
    for name, (fn, returns_tree) in cases.items():
        times = {"direct": [], "conversion": []}
        for step in range(args.steps + 3):
            for form in ("direct", "conversion"):
                t0 = time.perf_counter()
                if form == "direct":
                    fn(sharded, tangent)
                else:
                    out = fn(fs.to_local(sharded), fs.to_local(tangent))
                    if returns_tree:
                        fs.from_local(out) if name != "vmap(grad)" else out
                if step >= 3:
                    times[form].append(time.perf_counter() - t0)
        direct, conv = (statistics.median(times[f]) * 1e3 for f in ("direct", "conversion"))
        report[name] = {"direct_ms": direct, "conversion_ms": conv, "ratio": direct / conv}
    if dist.get_rank() == 0:
        print(f"{'transform':<12}{'direct ms':>11}{'conv. ms':>10}{'ratio':>8}")
        for name, r in report.items():
            print(f"{name:<12}{r['direct_ms']:>11.2f}{r['conversion_ms']:>10.2f}{r['ratio']:>8.2f}")
        print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
