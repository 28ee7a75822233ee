"""Part ``recompute``: activation checkpointing -- funcshard's plan (``fs.plan(...,
recompute=True)``) against FSDP2 + ``checkpoint_wrapper`` (non-reentrant) on every block, with
both frameworks without it for reference: peak memory per rank and step time, side by side.

The main job's transformer, at its benchmark batch (2 sequences of 64 per rank, where parameters,
gradients and optimizer state dominate) and at 16 sequences per rank (activations dominate).
Step times are timed in turn as in part ``step`` (see [Note: fair timing] in ``harness``); peaks
are accounted as in part ``memory`` (the median of three accounted steps). Ratios are to
FSDP2 + ``checkpoint_wrapper``; the target: funcshard with recompute peaks at most at
FSDP2 + activation checkpointing's peak, at no more step time.
"""

from __future__ import annotations

import gc
from typing import Any

from . import harness, memory, step_time
from .tables import measured, table, time_and_peak
from .variants import VARIANTS, Options
from .workloads import describe, transformer

BASELINE = "FSDP2 + checkpoint_wrapper"


def variants() -> dict[str, tuple[Any, Options]]:
    return {
        BASELINE: (VARIANTS["fsdp2"], Options(recompute=True)),
        "funcshard, recompute": (VARIANTS["funcshard"], Options(recompute=True)),
        "FSDP2": (VARIANTS["fsdp2"], Options()),
        "funcshard": (VARIANTS["funcshard"], Options()),
    }


def measure(ctx: harness.Context, workload, steps: int) -> dict[str, Any]:
    """Step time (ratios to the baseline) and the accounted peak of each variant."""
    rows = step_time.compare(ctx, workload, Options(), variants())
    for label, (fn, options) in variants().items():
        trainer = fn(workload, ctx.mesh, options)
        account = memory.median_step(trainer, workload, ctx, steps)
        del trainer
        gc.collect()
        rows[label].update(
            peak_all=account["peak_all"],
            peak_own=account["peak_own"],
            peak_all_range=account["peak_all_range"],
            activations=account["at_peak_all"]["activations + temporaries"],
        )
    base = rows[BASELINE]
    for row in rows.values():
        row["peak_ratio"] = row["peak_all"] / base["peak_all"]
        row["peak_own_ratio"] = row["peak_own"] / base["peak_own"]
    return rows


def run(ctx: harness.Context) -> dict[str, Any]:
    sizes = (2,) if ctx.quick else (2, 16)
    steps = 1 if ctx.quick else 3
    tables = []
    for sequences in sizes:
        workload = transformer(ctx.quick, sequences).to(ctx.device)
        tables.append(
            {
                "workload": describe(workload),
                "sequences": sequences,
                "rows": measure(ctx, workload, steps),
            }
        )
    return {"baseline": BASELINE, "memory_steps": steps, "tables": tables}


MiB = 2**20


def section(results: dict[str, Any]) -> str:
    """The generated block of BENCHMARKS.md (``<!-- bench:recompute -->``)."""
    r = next((v for k, v in sorted(results.items()) if k.startswith("recompute-")), None)
    if r is None:
        return ""

    res, out = r["result"], []
    base = res["baseline"]
    for t in res["tables"]:
        rows = [
            [
                label,
                *time_and_peak(v),
                f"{v['activations'] / MiB:.1f}",
                "-".join(f"{x / MiB:.0f}" for x in v["peak_all_range"]),
                f"{v['loss_gap']:.1e}",
            ]
            for label, v in t["rows"].items()
        ]
        out.append(
            f"**{t['workload']['description']}** ({t['workload']['parameters'] / 1e6:.1f}M "
            f"parameters), fp32: step times are medians of {r['rounds']} steps after "
            f"{r['warmup']} warm-up steps, peaks the median of {res['memory_steps']} accounted "
            f"steps; ratios to {base}."
        )
        out.append(
            table(
                [
                    "variant",
                    "step ms",
                    f"x {base}",
                    "peak MiB per rank",
                    f"x {base}",
                    "own thread MiB",
                    "activations + temporaries at the peak, MiB",
                    f"peak over {res['memory_steps']} steps",
                    "loss gap",
                ],
                rows,
            )
        )
    out.append(measured(r) + "\n")
    return "\n\n".join(out)


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    """One summary line per table: funcshard with recompute against FSDP2 + checkpointing."""
    r = next((v for k, v in sorted(results.items()) if k.startswith("recompute-")), None)
    out = []
    for t in r["result"]["tables"] if r else ():
        ours = t["rows"]["funcshard, recompute"]
        met = ours["peak_ratio"] <= 1.0 and ours["ratio"] <= 1.0
        out.append(
            [
                f"recompute, {t['workload']['name']} {t['sequences']} sequences per rank",
                "peak and step <= FSDP2 + checkpoint_wrapper",
                f"peak {ours['peak_ratio']:.2f}x, step {ours['ratio']:.2f}x",
                "yes" if met else "**no**",
            ]
        )
    return out
