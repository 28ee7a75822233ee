"""Part ``compile``: FSDP2 eager, FSDP2 + ``torch.compile(model)`` and with each block compiled
(torchtitan's way), funcshard eager, funcshard's whole training step compiled over
``fs.schedule`` and over ``fs.unshard``, and under ``fs.jit`` -- the
same training step (forward, backward, AdamW) of the same model on the same data, inductor (the
default backend; on CPU it compiles C++; ``--quick``: ``aot_eager``, which generates no code).
See ``variants.py`` for what each compiles; ``floor`` for the unsharded model compiled.

Per variant: the first call's time (for the compiled ones, compilation: Dynamo, AOTAutograd and
inductor, with cold caches -- a fresh inductor cache directory per variant, see
``_cold_caches`` -- in a process whose compiler is already started, see ``warm_compiler``),
the graphs it compiled and the recompilations after it (Dynamo frames counted by
``CompileCounterWithBackend("inductor")``), then the step time as part ``step`` measures it
(alternating, medians, ratios to FSDP2 eager; [Note: fair timing] in ``harness``), and the peak
memory per rank as part ``memory`` accounts it ([Note: memory categories]: the allocator's
events of a whole step; the step with the median peak of three). A variant that fails (at
construction or in its first call, on any rank) is recorded with its error and left out of the
rest.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from . import harness, memory, step_time
from .variants import VARIANTS, Options, Trainer, Variant
from .workloads import Workload, describe, transformer

BASELINE = "FSDP2"
LABELS = {  # label -> name in VARIANTS
    BASELINE: "fsdp2",
    "FSDP2 + torch.compile(model)": "fsdp2 + compile",
    "FSDP2 + torch.compile per block": "fsdp2 + compile per block",
    "funcshard": "funcshard",
    "funcshard, whole step compiled": "funcshard + compile",
    "funcshard over fs.unshard, whole step compiled": "funcshard.unshard + compile",
    "funcshard, fs.jit": "funcshard + fs.jit",
}
# compile time only, measured before the others (see ``floor``)
FLOOR = "torch, unsharded + torch.compile(model)"


def workload(quick: bool, layers: int | None = None) -> Workload:
    """The main job's transformer (``layers`` blocks, default 8); ``quick``: the tiny one, so
    compilation stays short."""
    return transformer(quick, layers=layers)


def _cold_caches():
    """A fresh, empty inductor cache (on-disk and in-memory) for one variant's compilation, so
    that no variant reuses kernels or graphs another one (or an earlier run) compiled."""
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # pragma: no cover - other torch versions
        return contextlib.nullcontext()
    return fresh_cache()


def warm_compiler(backend: str, device: str = "cpu") -> float:
    """Start the compiler once before any variant: a small function on ``device`` compiled with
    ``backend`` (forward and backward) under a fresh cache; its seconds.

    [Note: the compiler's start-up is nobody's]
    The first compilation in a process also starts inductor's machinery -- imports, the pool
    of C++ compile workers -- which every later one finds running. Measured inside the first
    variant, that start-up would count against whichever variant happens to come first. So it
    is paid here, and reported on its own; each variant then compiles in a warm process with
    cold caches, as a second model compiled in the same job would.
    """
    x = torch.randn(16, device=device, requires_grad=True)
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend=backend)
    t0 = time.perf_counter()
    with _cold_caches():
        f(x).backward()
    harness.sync(torch.device(device))
    seconds = time.perf_counter() - t0
    torch._dynamo.reset()
    return seconds


def floor(ctx: harness.Context, w: Workload, options: Options) -> dict[str, Any]:
    """The first call of the unsharded model under ``torch.compile(model)``: every block in one
    graph (no hooks break it), what compiling a whole step costs before any sharding.

    Measured first and then forgotten (``torch._dynamo.reset()``), compile time only: measured
    after FSDP2 + ``torch.compile(model)`` it would reuse the block that FSDP2's graph breaks
    compiled as a frame of its own, and a reset later would make the others compile again.
    """
    trainer, row = first_call(ctx, w, VARIANTS["plain + compile"], options, w.batch(0, ctx.rank))
    del trainer
    gc.collect()
    torch._dynamo.reset()
    return row


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:300]}"


def first_call(
    ctx: harness.Context, w: Workload, variant: Variant, options: Options, batch
) -> tuple[Trainer | None, dict[str, Any]]:
    """Build the variant and run its first step (compilation); the slowest rank's seconds. A
    failure on any rank drops the variant on every rank: the ranks agree after building and
    after the first step, so they stay in step (a rank failing in the middle of a collective
    still leaves the others waiting, as in any distributed job)."""
    trainer, row = None, {}
    try:
        trainer = variant(w, ctx.mesh, options)
    except Exception as e:  # reported in the results, never fatal to the suite
        row["error"] = _error(e)
    everyone = _agree(ctx, row)
    if "error" not in everyone[0]:
        try:
            dist.barrier()
            t0 = time.perf_counter()
            with _cold_caches():
                trainer.step(batch)
            harness.sync(ctx.device)
            row["first_call_s"] = time.perf_counter() - t0
        except Exception as e:
            row["error"] = _error(e)
        everyone = _agree(ctx, row)
    if "error" in everyone[0]:
        return None, {"error": everyone[0]["error"]}
    row["first_call_s"] = max(r["first_call_s"] for r in everyone)
    if trainer.counter is not None:
        row["graphs"] = trainer.counter.frame_count
    return trainer, row


def _agree(ctx: harness.Context, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``row``, the failed ones first (collective)."""
    everyone: list[dict[str, Any]] = [None] * ctx.world  # type: ignore[list-item]
    dist.all_gather_object(everyone, row)
    return sorted(everyone, key=lambda r: "error" not in r)


def run(ctx: harness.Context) -> dict[str, Any]:
    w = workload(ctx.quick).to(ctx.device)
    # --quick: aot_eager (Dynamo and AOTAutograd, no code generation) keeps it under a minute;
    # inductor's C++ compilation takes minutes per variant on 2 cores
    options = Options(compile_backend="aot_eager" if ctx.quick else "inductor")
    steps = 1 if ctx.quick else 3  # memory: accounted steps per variant
    rows: dict[str, dict[str, Any]] = {}
    trainers: dict[str, Trainer] = {}
    start_up = warm_compiler(options.compile_backend)  # see [Note: the compiler's start-up ...]
    unsharded = floor(ctx, w, options)
    for label in LABELS:
        variant = VARIANTS[LABELS[label]]
        trainer, rows[label] = first_call(ctx, w, variant, options, w.batch(0, ctx.rank))
        if ctx.rank == 0:  # progress: compiling takes minutes
            print(f"[bench] compile: {label}: {rows[label]}", flush=True)
        if trainer is not None:
            trainers[label] = trainer
    if BASELINE in trainers:
        for label, r in step_time.time_trainers(ctx, w, trainers).items():
            rows[label].update(r)
        base = None
        for label, trainer in trainers.items():
            acc = memory.median_step(trainer, w, ctx, steps)
            base = base or acc
            rows[label].update(
                peak_all=acc["peak_all"],
                peak_own=acc["peak_own"],
                peak_all_range=acc["peak_all_range"],
                peak_ratio=acc["peak_all"] / base["peak_all"],
                peak_own_ratio=acc["peak_own"] / base["peak_own"],
            )
            if trainer.counter is not None:
                rows[label]["recompiles"] = trainer.counter.frame_count - rows[label]["graphs"]
    trainers.clear()
    gc.collect()
    torch._dynamo.reset()  # drop the compiled code (and its guards) before the next part
    return {
        "workload": describe(w),
        "backend": options.compile_backend,
        "param_dtype": harness.dtype_name(options.param_dtype),
        "memory_steps": steps,
        "baseline": BASELINE,
        "compiler_start_up_s": start_up,
        "floor": {"label": FLOOR, **unsharded},
        "rows": rows,
    }
