"""Part ``overhead``: many small groups, where the per-group cost of the framework dominates.

Two models: 64 groups of one ``Linear(64, 64)``, and 64 groups of ~100 parameters
(``Linear(10, 10)``). For each: FSDP2 and funcshard with one group per layer, then funcshard
with ``fs.merge_groups`` at a few byte budgets, and FSDP2 with the same merged groups
(``fully_shard`` on lists of modules: FSDP2 can group by hand what the pass groups for you).
Measured twice: on the real ranks (gloo), and in one process over a fake process group
(``fake.py``: collectives move nothing), which isolates the frameworks' own CPU work per step.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
from typing import Any

import torch

from . import harness, step_time
from .fake import fake_world
from .variants import VARIANTS, Options, module_groups, plan_for
from .workloads import Workload, describe, overhead_models

BUDGETS = {"64x64": (64 * 2**10, 256 * 2**10, 2 * 2**20), "10x10": (4 * 2**10, 64 * 2**10)}


def _budgets(w: Workload, quick: bool) -> tuple[int, ...]:
    budgets = BUDGETS["64x64" if "64x64" in w.name else "10x10"]
    return budgets[:1] if quick else budgets


def _table(ctx: harness.Context, w: Workload) -> dict[str, Any]:
    variants = {
        "FSDP2": (VARIANTS["fsdp2"], Options()),
        "funcshard": (VARIANTS["funcshard"], Options()),
    }
    plans = {}
    for budget in _budgets(w, ctx.quick):
        merged = plan_for(w, w.build(), Options(merge_bytes=budget))
        n = len(merged.groups)
        label = f"funcshard, merge_groups <= {budget // 1024} KiB ({n} groups)"
        variants[label] = (VARIANTS["funcshard"], Options(merge_bytes=budget))
        variants[f"FSDP2, the same {n} groups"] = (
            VARIANTS["fsdp2"],
            Options(module_groups=module_groups(merged)),
        )
        plans[label] = [[g.name, len(g.params)] for g in merged.groups]
    rows = step_time.compare(ctx, w, Options(), variants)
    return {"workload": describe(w), "rows": rows, "merged_plans": plans}


def run(ctx: harness.Context) -> dict[str, Any]:
    """On the real ranks."""
    return {"tables": [_table(ctx, w.to(ctx.device)) for w in overhead_models(ctx.quick)]}


def run_fake(quick: bool, rounds: int, warmup: int) -> dict[str, Any]:
    """In this process, over a fake 2-rank process group: the frameworks' own CPU cost."""
    tables = []
    with fake_world(2) as mesh:
        ctx = harness.Context(mesh, torch.device("cpu"), quick, rounds, warmup)
        for w in overhead_models(quick):
            table = _table(ctx, w)
            if not quick:  # where the time goes, for people (not in the report's tables)
                table["profile"] = {
                    name: _profile(VARIANTS[name](w, mesh, Options()), w)
                    for name in ("fsdp2", "funcshard")
                }
            tables.append(table)
    return {"tables": tables}


def _profile(trainer, w: Workload, steps: int = 3, top: int = 12) -> list[dict[str, Any]]:
    """The functions with the most own time in a few steps (cProfile), per step."""
    batch = w.batch(0, 0)
    trainer.step(batch)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        trainer.step(batch)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    del trainer
    gc.collect()
    return [
        {
            "function": f"{_short(file)}:{line}({fn})",
            "calls_per_step": calls / steps,
            "own_ms_per_step": 1e3 * own / steps,
            "cumulative_ms_per_step": 1e3 * cum / steps,
        }
        for (file, line, fn), (_, calls, own, cum, _) in rows
    ]


def _short(path: str) -> str:
    for root in ("site-packages/", "funcshard/"):
        if root in path:
            return (
                path.split(root, 1)[1]
                if root == "site-packages/"
                else "funcshard/" + path.split(root, 1)[1]
            )
    return path
