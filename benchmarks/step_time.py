"""Part ``step``: training step time (forward, backward, AdamW step) of the transformer,
funcshard / FSDP2, fp32 and bf16 parameters (fp32 reduce), reshard after forward on and off.

See [Note: fair timing] in ``harness``. The losses of both frameworks are recorded too: they
start from the same weights on the same data with the same optimizer arithmetic, so they must
stay equal up to rounding -- a check that both train the same model.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from . import harness
from .variants import VARIANTS, Options, Trainer
from .workloads import describe, transformer

CONFIGS = [
    (dtype, reshard) for dtype in (None, torch.bfloat16) for reshard in (True, False)
]  # (param_dtype, reshard_after_forward)


def compare(ctx: harness.Context, workload, options: Options, variants=None) -> dict[str, Any]:
    """Time the training steps of ``variants`` (names in ``VARIANTS``, or ``{label: (variant,
    options)}``) on ``workload``; ratios to the first one."""
    if variants is None:
        variants = {name: (VARIANTS[name], options) for name in ("fsdp2", "funcshard")}
    trainers = {label: fn(workload, ctx.mesh, o) for label, (fn, o) in variants.items()}
    result = time_trainers(ctx, workload, trainers)
    trainers.clear()  # free both models before the next comparison
    gc.collect()
    return result


def time_trainers(ctx: harness.Context, workload, trainers: dict[str, Trainer]) -> dict[str, Any]:
    """Time the training steps of ``trainers`` (see [Note: fair timing]); ratios and loss gaps
    to the first one."""
    batches = [workload.batch(i, ctx.rank) for i in range(ctx.warmup + ctx.rounds)]
    losses: dict[str, list[float]] = {label: [] for label in trainers}

    def stepper(label):
        def step(i):
            losses[label].append(trainers[label].step(batches[i]).item())

        return step

    times = harness.alternate(
        {label: stepper(label) for label in trainers},
        rounds=ctx.rounds,
        warmup=ctx.warmup,
        device=ctx.device,
    )
    base = next(iter(trainers))
    result = harness.summary(times, base)
    for label in trainers:
        result[label]["loss_gap"] = max(
            abs(a - b) / max(abs(b), 1e-12)
            for a, b in zip(losses[label], losses[base], strict=True)
        )
    return result


def run(ctx: harness.Context) -> dict[str, Any]:
    workload = transformer(ctx.quick).to(ctx.device)
    rows = []
    for dtype, reshard in CONFIGS[::2] if ctx.quick else CONFIGS:
        options = Options(param_dtype=dtype, reshard_after_forward=reshard)
        variants = {name: (VARIANTS[name], options) for name in ("fsdp2", "funcshard")}
        if reshard and not ctx.quick:  # gloo's plan choices (docs/schedule.md), timed too
            bp0 = dataclasses.replace(options, backward_prefetch=0)
            variants["funcshard, backward_prefetch=0"] = (VARIANTS["funcshard"], bp0)
            none = dataclasses.replace(bp0, prefetch=0)
            variants["funcshard, no prefetch"] = (VARIANTS["funcshard"], none)
        result = compare(ctx, workload, options, variants)
        for label, r in result.items():
            if label == "fsdp2":
                continue
            rows.append(
                {
                    "variant": label,
                    "param_dtype": harness.dtype_name(dtype),
                    "reshard_after_forward": reshard,
                    "fsdp2_ms": result["fsdp2"]["ms"],
                    "funcshard_ms": r["ms"],
                    "ratio": r["ratio"],
                    "loss_gap": r["loss_gap"],
                }
            )
    return {"workload": describe(workload), "rows": rows}
