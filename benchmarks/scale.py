"""Part ``scale``: plans and per-rank parameter memory for world sizes 8 to 1024 and models up
to ~70B parameters, without the machines: meta-device models over a fake process group.

- **Memory**: rank 0's sharded parameters (``fs.shard`` of the meta tree: the local shapes
  rank 0 would hold) plus the plan's *unsharded window*, the most unsharded parameter bytes the
  plan holds at any of its steps (its all-gathers and frees, forward and backward, in the
  gathered dtype). It should follow ``P / W + window``: the window does not shrink with ``W``.
- **Time**: ``fs.plan`` and ``fs.shard`` of the meta tree for models of growing depth (the
  number of parameter tensors grows with the layers), which should grow linearly.

Parameters in fp32, gathered in bf16 (``param_dtype``); groups: every block, the embedding and
the head, and the root (the final norm), as torchtitan wraps Llama.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import funcshard as fs

from .fake import fake_world
from .workloads import LLAMA_SHAPES, LlamaBlock, count, meta_llama

WORLDS = (8, 32, 128, 512, 1024)
GATHER = torch.bfloat16


def policy() -> fs.policy.Policy:
    return fs.policy.any_of(fs.policy.by_type(LlamaBlock), fs.policy.by_names(["embed", "head"]))


def window(plan: fs.Plan, group_bytes: dict[str, int]) -> int:
    """The most unsharded bytes the plan's steps hold at once (a gather holds its group from
    the ``all_gather`` step until its ``free``)."""
    held: set[str] = set()
    peak = 0
    for step in (*plan.forward, *plan.backward):
        if step.op == "all_gather":
            held.add(step.group)
        elif step.op == "free":
            held.discard(step.group)
        peak = max(peak, sum(group_bytes[g] for g in held))
    return peak


def _timed(fn, repeats: int) -> tuple[float, Any]:
    """The fastest of ``repeats`` calls (deterministic CPU work: the minimum is the least
    disturbed by other jobs on the machine), and the result."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def memory_rows(shapes: dict[str, tuple[int, ...]], worlds=WORLDS) -> list[dict[str, Any]]:
    rows = []
    for name, shape in shapes.items():
        model = meta_llama(*shape)
        params, _ = fs.extract(model)
        total = count(model)
        plan = fs.plan(model, policy())
        sizes = {k: p.numel() * GATHER.itemsize for k, p in params.items()}
        group_bytes = {g.name: sum(sizes[p] for p in g.params) for g in plan.groups}
        win = window(plan, group_bytes)
        for world in worlds:
            with fake_world(world) as mesh:
                sharded = fs.shard(params, mesh)
                local = sum(v.to_local().numel() * v.element_size() for v in sharded.values())
            rows.append(
                {
                    "model": name,
                    "parameters": total,
                    "world": world,
                    "shard_gib": local / 2**30,
                    "window_gib": win / 2**30,
                    "per_rank_gib": (local + win) / 2**30,
                    "formula_gib": (4 * total / world + win) / 2**30,
                }
            )
    return rows


def time_rows(depths, repeats: int, shape=LLAMA_SHAPES["7B"], world: int = 8) -> list[dict]:
    rows = []
    for layers in depths:
        model = meta_llama(layers, *shape[1:])
        params, _ = fs.extract(model)
        plan_s, _ = _timed(lambda model=model: fs.plan(model, policy()), repeats)
        with fake_world(world) as mesh:
            shard_s, _ = _timed(lambda params=params, mesh=mesh: fs.shard(params, mesh), repeats)
        rows.append(
            {
                "layers": layers,
                "parameters": count(model),
                "tensors": len(params),
                "plan_ms": 1e3 * plan_s,
                "shard_ms": 1e3 * shard_s,
            }
        )
    return rows


def run(quick: bool) -> dict[str, Any]:
    if quick:
        shapes = {"tiny": (2, 64, 128, 256, 64)}
        memory = memory_rows(shapes, worlds=(8, 1024))
        timing = time_rows((2, 4), repeats=1, shape=shapes["tiny"])
    else:
        memory = memory_rows(LLAMA_SHAPES)
        timing = time_rows((8, 16, 32, 64, 128, 256), repeats=15)
    return {"memory": memory, "timing": timing, "gathered_dtype": "bf16", "param_dtype": "fp32"}


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a x + b`` and its R^2 (how linear the growth is)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    b = my - a * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - (a * x + b)) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1 - res / ss if ss else 1.0
