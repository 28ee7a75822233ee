"""Part ``gpu``: the training step on one GPU, every way of running it, side by side.

The Llama-style decoder of ``host.py`` (RMSNorm, SDPA with rotary embeddings, SwiGLU, untied
head) at four sizes (36M to 953M parameters), bf16 compute with fp32 master weights and fp32
gradient reduction, AdamW (fused where torch has the kernel), one group per block and the root,
world size 1 (NCCL; ``--device cpu``: gloo). Variants:

- ``plain torch``: unsharded, ``torch.autocast`` to bf16 -- the floor;
- ``plain torch, CUDA graph``: the same whole step (forward, backward, ``AdamW(capturable=True)``)
  captured once with ``torch.cuda.graph`` and replayed on static inputs;
- ``FSDP2`` (``MixedPrecisionPolicy(bf16, reduce fp32)``) and ``FSDP2 + compile per block``;
- ``funcshard``: ``fs.schedule`` + ``fs.value_and_grad`` + ``fs.optim.step``
  (``param_dtype=bf16, reduce_dtype=fp32``); ``funcshard, compiled``: that whole step under
  ``torch.compile(fullgraph=True)``; ``funcshard, CUDA graph``: that whole step through
  ``fs.cuda_graph`` (AdamW's counts on the device); ``funcshard, compiled, CUDA graph``: the
  compiled step through ``fs.cuda_graph`` (inductor's kernels, replayed as one graph);
  ``funcshard, fs.jit`` and ``funcshard, fs.jit, CUDA graph``: the same with the step traced by
  ``fs.jit`` instead of ``torch.compile``.

``--fake-world N``: the same on a fake process group of ``N`` ranks (``fake.py``: collectives
return at once, moving nothing; every other part of one rank's step is real), on the GPU or, with
``--device cpu``, on the CPU: the host's work of a rank of an ``N``-rank job, measured without
``N`` GPUs. Every variant also reports its aten calls and (CUDA) kernel launches per step, from
the profiler (on CPU: the aten calls that call no other, each a kernel of its own on a GPU).
Besides the steps, AdamW alone on the model's shards: ``torch.optim.AdamW(fused=True)`` against
``fs.optim.step`` of ``fs.optim.adamw(fused=True)`` (and both ``capturable=True``), ms per step.

A variant that cannot run here says why (``skipped``); one that fails (building, its first
steps, a capture, a replay) keeps its error and traceback in the result (``error``,
``details``). Per variant: step time (median over rounds, the variants alternating step by step
in one process: [Note: fair timing] in ``harness``) and its ratios to FSDP2 and to plain torch,
host time (the step thread's CPU time, before the synchronisation), GPU busy fraction (kernel
time per step from ``torch.profiler`` over a few steps, the union of the kernels' intervals, /
the step time), MFU (6 x parameters x tokens / step time / ``--peak-tflops``), peak memory and
the loss after the timed steps, with its gap to plain torch's (all start from the same weights
and see the same batches). See ``_peak_bytes`` for what peak memory counts.

    python -m benchmarks.gpu                     # all four, NCCL: results/gpu-cuda-<config>.json
    python -m benchmarks.gpu --configs 36M,271M --variants "FSDP2,funcshard"
    python -m benchmarks.gpu --quick --device cpu            # tiny, gloo, < 1 min
    python -m benchmarks.gpu --configs 36M --fake-world 8    # results/gpu-cuda-36M-fake8.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import re
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from . import compile as compiled
from . import harness, memory, timeline
from .host import Llama, LlamaBlock
from .tables import measured, table
from .variants import VARIANTS, Options, Trainer
from .workloads import Workload, _lm_loss

DTYPE = torch.bfloat16
PLAIN, FSDP2 = "plain torch", "FSDP2"
PROLOGUE = 3  # steps before the timing: compilation, optimizer state, CUDA-graph capture


@dataclasses.dataclass(frozen=True)
class Config:
    """A model size and its batch (``batch`` sequences of ``seq`` tokens per step)."""

    width: int
    layers: int
    batch: int
    seq: int
    vocab: int
    heads: int

    @property
    def hidden(self) -> int:
        """Llama's SwiGLU width: 8/3 of the model's, rounded up to a multiple of 256."""
        return 256 * math.ceil(8 * self.width / 3 / 256)

    def describe(self) -> str:
        return (
            f"d={self.width}, {self.layers} blocks, batch {self.batch}x{self.seq}, "
            f"{self.heads} heads, SwiGLU {self.hidden}, vocab {self.vocab}"
        )


# the parameter counts name them
CONFIGS = {
    "36M": Config(512, 8, 4, 512, 8192, 8),
    "117M": Config(512, 32, 4, 512, 8192, 8),
    "271M": Config(1024, 16, 8, 1024, 32000, 8),
    "953M": Config(2048, 16, 4, 2048, 32000, 16),
}
QUICK = {"tiny": Config(64, 2, 2, 32, 256, 4)}


def workload(name: str, c: Config, device: torch.device) -> Workload:
    """The model built on ``device`` (the same seed for every variant), random tokens as
    batches, next-token cross entropy."""

    def build() -> Llama:
        torch.manual_seed(0)
        with device:
            model = Llama(c.layers, c.width, c.heads, c.vocab, c.seq, hidden=c.hidden)
        # the rotary tables in the compute dtype: bf16 queries stay bf16 (FSDP2 casts a block's
        # inputs, autocast SDPA's; funcshard computes with the buffers as given)
        model.cos, model.sin = model.cos.to(DTYPE), model.sin.to(DTYPE)
        return model

    def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, c.vocab, (c.batch, c.seq), generator=g).to(device),)

    return Workload(name, c.describe(), build, (LlamaBlock,), batch, _lm_loss)


def parameters(c: Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(c.layers, c.width, c.heads, c.vocab, c.seq,
                                            hidden=c.hidden).parameters())  # fmt: skip


# ------------------------------------------------------------------------------ variants


def variants(device: torch.device, backend: str) -> dict[str, tuple[Callable, Options] | str]:
    """``{label: (variant, options)}``, or ``{label: why it is skipped here}``. AdamW asks for
    torch's fused kernel everywhere (in the compiled whole step funcshard traces the unfused
    one, which inductor fuses: torch keeps its fused kernel out of graphs)."""
    o = Options(param_dtype=DTYPE, fused=device.type in ("cuda", "cpu"), compile_backend=backend)
    no_graphs = None if device.type == "cuda" else "CUDA graphs need a CUDA device (--device cuda)"
    return {
        PLAIN: (VARIANTS["plain"], o),
        "plain torch, CUDA graph": no_graphs
        or (VARIANTS["plain + CUDA graph"], dataclasses.replace(o, capturable=True)),
        FSDP2: (VARIANTS["fsdp2"], o),
        "FSDP2 + compile per block": (VARIANTS["fsdp2 + compile per block"], o),
        "funcshard": (VARIANTS["funcshard"], o),
        "funcshard, compiled": (VARIANTS["funcshard + compile"], o),
        "funcshard, CUDA graph": no_graphs or (VARIANTS["funcshard + fs.cuda_graph"], o),
        "funcshard, compiled, CUDA graph": no_graphs
        or (VARIANTS["funcshard + compile + fs.cuda_graph"], o),
        "funcshard, fs.jit": (VARIANTS["funcshard + fs.jit"], o),
        "funcshard, fs.jit, CUDA graph": no_graphs
        or (VARIANTS["funcshard + fs.jit + fs.cuda_graph"], o),
    }


def _failure(e: BaseException, phase: str) -> dict[str, Any]:
    """The error of a variant, in full: its first line for the table, the message and the
    traceback (chained causes included) for whoever runs it next."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    short = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "... raised:" + why
    details = "".join(traceback.format_exception(e))
    return {
        "error": f"{type(e).__name__}: {short[:300]}",
        "phase": phase,
        "details": details[-12000:],
    }


def _prologue(
    w: Workload, mesh, variant, options, batches, device, cold: bool = True
) -> tuple[Trainer, dict]:
    """Build a variant and run its first steps (``batches``); the first step's seconds
    (compilation, for the compiled ones: with empty caches, unless not ``cold``) and the device
    memory it keeps between steps."""
    harness.sync(device)
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    trainer = variant(w, mesh, options)
    row: dict[str, Any] = {}
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        with compiled._cold_caches() if i == 0 and cold else contextlib.nullcontext():
            trainer.step(batch)
        harness.sync(device)
        if i == 0:
            row["first_call_s"] = time.perf_counter() - t0
    if trainer.counter is not None:
        row["graphs"] = trainer.counter.frame_count
    if device.type == "cuda":
        row["resident_bytes"] = torch.cuda.memory_allocated() - allocated
    return trainer, row


# ------------------------------------------------------------------------------ measuring


def _kernel_ms(trainer: Trainer, batches, device: torch.device) -> float | None:
    """GPU time per step: the union of the kernels' (and copies') intervals over ``batches``."""
    if device.type != "cuda":
        return None
    harness.sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            trainer.step(batch)
        harness.sync(device)
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    if not spans:
        return None  # the profiler saw no kernel (a replayed graph's, on some CUPTI versions)
    return sum(b - a for a, b in timeline.merge(spans)) / 1e3 / len(batches)


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
             "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip


def _calls(trainer: Trainer, batches, device: torch.device) -> dict[str, float]:
    """Aten calls and kernel launches per step (the profiler's events over ``batches``). A
    launch is any of ``_LAUNCHES`` (a graph's replay is one); on CPU, ``launches`` counts the
    aten calls that would each launch a kernel on a GPU (``harness.launches_on_cpu``)."""
    harness.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for batch in batches:
            trainer.step(batch)
        harness.sync(device)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    if device.type == "cuda":
        launches = sum(1 for e in events if e.name in _LAUNCHES)
    else:
        launches = harness.launches_on_cpu(aten)
    n = len(batches)
    return {"aten_calls": len(aten) / n, "launches": launches / n}


def _peak_bytes(trainer: Trainer, row: dict, batch, device: torch.device) -> int:
    """Peak memory of one step of this variant alone. CUDA: what it keeps between steps
    (allocated across its build and first steps: parameters, optimizer state, caches, a
    graph's live outputs) + what one step allocates above its start
    (``torch.cuda.max_memory_allocated``) + a CUDA graph's pool beyond its live tensors. CPU: the
    all-threads peak of ``memory.profile_step`` (the allocator's events)."""
    if device.type != "cuda":
        return memory.profile_step(trainer, batch, device)["peak_all"]
    harness.sync(device)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.step(batch)
    harness.sync(device)
    return row["resident_bytes"] + torch.cuda.max_memory_allocated() - start + row.get("pool", 0)


def measure(
    name: str, c: Config, mesh, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """Every variant on one configuration: a row each (measured, skipped or failed)."""
    w = workload(name, c, device)
    total = PROLOGUE + args.warmup + args.rounds + 4
    batches = [w.batch(i, 0) for i in range(total)]
    rows: dict[str, dict[str, Any]] = {}
    trainers: dict[str, Trainer] = {}
    for label, spec in variants(device, args.backend).items():
        if args.variants and label not in args.variants:
            continue
        if isinstance(spec, str):
            rows[label] = {"skipped": spec}
            continue
        try:
            trainers[label], rows[label] = _prologue(w, mesh, *spec, batches[:PROLOGUE], device)
        except Exception as e:  # recorded, never fatal to the others
            rows[label] = _failure(e, "build and first steps")
            gc.collect()
        print(f"[gpu] {name} {label}: {_short(rows[label])}", flush=True)
    losses = _time(trainers, rows, batches[PROLOGUE:], device, args)
    if args.fake_world:
        targets = _ratios(rows, losses, TARGETS_RANKS, firsts=())
    else:
        targets = _ratios(rows, losses, TARGETS, FIRST_CALL_TARGETS)
    tokens, params = c.batch * c.seq, parameters(c)
    flop = 6 * params * tokens  # per step: forward + backward of every parameter, no attention
    after = batches[PROLOGUE + args.warmup + args.rounds :]
    for label, trainer in trainers.items():
        if "error" not in rows[label]:
            _profile(trainer, rows[label], after, device, flop, args.peak_tflops)
    trainers.clear()
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    optimizer = optimizer_cost(w, mesh, device, args) if args.optimizer else {}
    gc.collect()
    targets += _more_targets(rows, optimizer, ranks=bool(args.fake_world))
    return {
        "world": mesh.size(),
        "fake": bool(args.fake_world),
        "optimizer": optimizer,
        "name": name,
        "config": dataclasses.asdict(c) | {"hidden": c.hidden},
        "description": c.describe(),
        "parameters": params,
        "tokens": tokens,
        "rows": rows,
        "targets": targets,
    }


def _profile(trainer: Trainer, row: dict, batches, device, flop: int, peak: float | None) -> None:
    """GPU busy fraction, MFU and peak memory of one variant into its ``row``."""
    try:
        kernel = _kernel_ms(trainer, batches[:3], device)
        row.update(_calls(trainer, batches[:2], device))
        row.update(_pool(trainer))
        row["peak_bytes"] = _peak_bytes(trainer, row, batches[3], device)
    except Exception as e:
        row.update(_failure(e, "profiling"))
        return
    row["kernel_ms"] = kernel
    row["busy"] = None if kernel is None else kernel / row["ms"]
    row["mfu"] = None if peak is None else flop / (row["ms"] / 1e3) / (peak * 1e12)


def _pool(trainer: Trainer) -> dict[str, Any]:
    """A CUDA graph's pool beyond its live tensors (``pool``, bytes; 0 without a graph) and how
    it was measured (``pool_measure``: ``variants.pool_free_bytes``)."""
    got = {"pool": 0, "pool_measure": ""}
    for key, name in (("pool", "pool_extra"), ("pool_measure", "pool_measure")):
        value = getattr(trainer.forward_backward, name, got[key])
        got[key] = value() if callable(value) else value
    return got


def _time(trainers, rows, batches, device, args) -> dict[str, list[torch.Tensor]]:
    """Alternate the variants step by step; wall and host milliseconds into ``rows``. A variant
    that raises is recorded and left out from then on."""
    losses: dict[str, list[torch.Tensor]] = {label: [] for label in trainers}
    host: dict[str, list[float]] = {}

    def stepper(label: str):
        def step(i: int) -> None:
            if "error" in rows[label]:
                return
            try:
                losses[label].append(trainers[label].step(batches[i]))
            except Exception as e:
                rows[label].update(_failure(e, f"timed step {i}"))

        return step

    wall = harness.alternate(
        {label: stepper(label) for label in trainers},
        rounds=args.rounds, warmup=args.warmup, device=device, host=host,
    )  # fmt: skip
    for label in trainers:
        if "error" not in rows[label]:
            rows[label]["wall"], rows[label]["host"] = wall[label], host[label]
    return losses


# the targets: (variant, baseline, at most); at one rank, and at several (fake) ranks
TARGETS = (
    ("funcshard", FSDP2, 0.85),
    ("funcshard, CUDA graph", "plain torch, CUDA graph", 1.02),
    ("funcshard, compiled", PLAIN, 0.9),
    ("funcshard, compiled, CUDA graph", "plain torch, CUDA graph", 0.9),
    ("funcshard, fs.jit", PLAIN, 0.9),
    ("funcshard, fs.jit, CUDA graph", "plain torch, CUDA graph", 0.9),
)
# the first step (compilation) of the compiled step against FSDP2 + compile's, at one rank
FIRST_CALL_TARGETS = (
    ("funcshard, compiled", "FSDP2 + compile per block", 2.0),
    ("funcshard, fs.jit", "FSDP2 + compile per block", 2.0),
)
TARGETS_RANKS = (("funcshard", FSDP2, 0.85), ("funcshard, CUDA graph", FSDP2, 0.5))
# the eager step each compiled or captured variant runs: their losses should agree closely
EAGER = {
    "plain torch, CUDA graph": PLAIN,
    "FSDP2 + compile per block": FSDP2,
    "funcshard, compiled": "funcshard",
    "funcshard, CUDA graph": "funcshard",
    "funcshard, compiled, CUDA graph": "funcshard",
    "funcshard, fs.jit": "funcshard",
    "funcshard, fs.jit, CUDA graph": "funcshard",
}


# beyond step time: a CUDA graph's peak memory against its eager step's (the graph's pool
# counted whole: ``variants.pool_free_bytes``); at several ranks, funcshard's aten calls and
# kernel launches per step against FSDP2's; AdamW alone on the shards against torch.optim's
MEMORY_TARGETS = (("funcshard, CUDA graph", "funcshard", 1.05),)
COUNT_TARGETS = (("funcshard", FSDP2, 1.0),)
OPTIMIZER_TARGETS = tuple(
    (f"fs.optim.adamw({k}=True)", f"torch.optim.AdamW({k}=True)", 1.0)
    for k in ("fused", "capturable")
)


def _more_targets(rows: dict[str, dict[str, Any]], optimizer: dict, ranks: bool) -> list:
    """``MEMORY_TARGETS``, ``COUNT_TARGETS`` (at several ranks) and ``OPTIMIZER_TARGETS`` as
    ``[a, b, at most, a / b]`` (``None``: not measured)."""

    def ratio(a, b) -> float | None:
        return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None

    def of(label: str, key: str):
        return rows.get(label, {}).get(key)

    out = [[f"{a}, peak memory", f"{b}, peak memory", at, ratio(of(a, "peak_bytes"),
            of(b, "peak_bytes"))] for a, b, at in MEMORY_TARGETS]  # fmt: skip
    for a, b, at in COUNT_TARGETS if ranks else ():
        for key in ("aten_calls", "launches"):
            out.append([f"{a}, {key}", f"{b}, {key}", at, ratio(of(a, key), of(b, key))])
    for a, b, at in OPTIMIZER_TARGETS if optimizer else ():
        out.append([a, b, at, ratio(optimizer.get(a), optimizer.get(b))])
    return out


def _ratios(
    rows: dict[str, dict[str, Any]],
    losses: dict[str, list[torch.Tensor]],
    targets=TARGETS,
    firsts=FIRST_CALL_TARGETS,
) -> list:
    """Medians into ``rows``, with the per-round ratios to FSDP2 and to plain torch, the last
    loss and its relative gaps to plain torch's and to its own eager step's (``EAGER``); the
    targets' ratios, then the ratios of the first steps of ``firsts`` (``None``: not
    measured)."""
    timed = {label: row.pop("wall") for label, row in rows.items() if "wall" in row}
    host = {label: rows[label].pop("host") for label in timed}
    ratio = lambda a, b: harness.summary(timed, b)[a]["ratio"] if {a, b} <= set(timed) else None
    final = {label: losses[label][-1].float().item() for label in timed}
    gap = lambda a, b: abs(final[a] / final[b] - 1) if b in final else None
    for label, ts in timed.items():
        rows[label].update(
            ms=1e3 * statistics.median(ts),
            rounds=len(ts),
            host_ms=1e3 * statistics.median(host[label]),
            x_fsdp2=ratio(label, FSDP2),
            x_plain=ratio(label, PLAIN),
            loss=final[label],
            loss_gap=gap(label, PLAIN),
            loss_gap_eager=gap(label, EAGER[label]) if label in EAGER else None,
        )
    first = lambda a, b: (
        rows[a]["first_call_s"] / rows[b]["first_call_s"]
        if all("first_call_s" in rows.get(x, {}) for x in (a, b)) else None
    )  # fmt: skip
    return [[a, b, at, ratio(a, b)] for a, b, at in targets] + [
        [f"{a}, first step", f"{b}, first step", at, first(a, b)] for a, b, at in firsts
    ]


def optimizer_cost(w: Workload, mesh, device: torch.device, args) -> dict[str, float | str]:
    """AdamW alone on the model's shards, ms per step (medians, alternating): torch.optim's
    ``AdamW`` on the local shards as parameters, against ``fs.optim.step`` of ``fs.optim.adamw``
    on the sharded tree, each fused and capturable (on CPU, fused only). A variant that fails
    keeps its error."""
    import funcshard as fs
    from funcshard._trees._dtensor import placed_like

    model = w.build()
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh)
    del model, params
    g = torch.Generator(device=device).manual_seed(0)
    grads = {k: placed_like(torch.randn(v.to_local().shape, generator=g, device=device), v)
             for k, v in sharded.items()}  # fmt: skip
    kinds = {"fused": dict(fused=True)}
    if device.type == "cuda":
        kinds["capturable"] = dict(capturable=True)
    steps: dict[str, Callable[[int], None]] = {}
    out: dict[str, float | str] = {}
    for kind, kw in kinds.items():
        try:
            leaves = [torch.nn.Parameter(v.to_local().detach().clone()) for v in sharded.values()]
            for p, gr in zip(leaves, grads.values(), strict=True):
                p.grad = gr.to_local().clone()
            topt = torch.optim.AdamW(leaves, lr=1e-3, weight_decay=0.1, **kw)
            steps[f"torch.optim.AdamW({kind}=True)"] = lambda i, o=topt: o.step()
            opt = fs.optim.adamw(1e-3, weight_decay=0.1, **kw)
            box = {"p": {k: placed_like(v.to_local().clone(), v) for k, v in sharded.items()}}
            box["s"] = opt.init(box["p"])

            def fs_step(i, opt=opt, box=box):
                box["p"], box["s"] = fs.optim.step(opt, box["p"], dict(grads), box["s"])

            steps[f"fs.optim.adamw({kind}=True)"] = fs_step
        except Exception as e:
            out[kind] = _failure(e, "optimizer")["error"]
    if not steps:
        return out
    try:
        times = harness.alternate(steps, rounds=args.rounds, warmup=args.warmup, device=device)
    except Exception as e:
        return out | {"error": _failure(e, "optimizer")["error"]}
    for label, ts in times.items():
        out[label] = 1e3 * statistics.median(ts)
    return out


def _short(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"FAILED ({row['phase']}): {row['error']}"
    return f"first step {row['first_call_s']:.1f} s"


# ------------------------------------------------------------------------------ the report


def _results(results: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """The results of this part on ``device`` (``gpu-<device>-<config>.json``), configs in
    the order of ``CONFIGS``."""
    order = [*CONFIGS, *QUICK]
    found = [r for k, r in results.items() if k.startswith(f"gpu-{device}-")]
    world = lambda r: (r["result"].get("fake", False), r["result"].get("world", 1))
    return sorted(found, key=lambda r: (world(r), order.index(r["result"]["name"])))


def section(results: dict[str, Any]) -> str:
    """The generated block of BENCHMARKS.md (``<!-- bench:gpu -->``): a table per config, from
    the GPU's results (or, where there are none, a CPU run's)."""
    found = _results(results, "cuda") or _results(results, "cpu")
    if not found:
        return "*No result yet: pending a run on the GPU machine (`python -m benchmarks.gpu`).*\n"

    out = []
    for r in found:
        cfg, peak = r["result"], r["result"]["peak_tflops"]
        ranks = f", {cfg['world']} fake ranks" if cfg.get("fake") else ""
        out.append(
            f"**{cfg['name']}{ranks}** ({cfg['parameters'] / 1e6:.1f}M parameters; "
            f"{cfg['description']}): medians of {r['rounds']} alternating steps after "
            f"{r['warmup']} warm-up steps; "
            + (f"MFU against {peak:g} bf16 TFLOP/s." if peak else "no MFU (no peak given).")
        )
        out.append(table(HEADER, [[label, *_cells(row)] for label, row in cfg["rows"].items()]))
        said = _targets(cfg["targets"]) + _optimizer(cfg.get("optimizer") or {})
        out.append(said + "\n\n" + measured(r) + "\n")
    return "\n\n".join(out)


def _optimizer(times: dict[str, Any]) -> str:
    """AdamW alone on the shards: fs.optim's ms per step against torch.optim's, per kernel."""
    said = []
    for kind in ("fused", "capturable"):
        a = times.get(f"fs.optim.adamw({kind}=True)")
        b = times.get(f"torch.optim.AdamW({kind}=True)")
        if isinstance(a, float) and isinstance(b, float):
            said.append(f"{kind}: {a:.2f} ms vs torch.optim.AdamW's {b:.2f} ms ({a / b:.2f}x)")
        elif kind in times:
            said.append(f"{kind}: failed (`{times[kind]}`)")
    return f" AdamW alone on the shards, per step: {'; '.join(said)}." if said else ""


HEADER = ["variant", "step ms", "x FSDP2", "x plain", "host ms", "GPU busy", "MFU",
          "peak MiB", "first step s", "loss gap", "to eager", "aten calls", "launches"]  # fmt: skip


def _cells(row: dict[str, Any]) -> list[str]:
    if "skipped" in row:
        return [f"skipped: {row['skipped']}", *["-"] * (len(HEADER) - 2)]
    if "error" in row:
        return [f"failed ({row['phase']}): `{row['error']}`", *["-"] * (len(HEADER) - 2)]
    num = lambda x, f: "-" if x is None else f.format(x)
    return [
        f"{row['ms']:.1f}",
        num(row["x_fsdp2"], "**{:.2f}**"),
        num(row["x_plain"], "{:.2f}"),
        f"{row['host_ms']:.1f}",
        num(row["busy"], "{:.0%}"),
        num(row["mfu"], "{:.1%}"),
        f"{row['peak_bytes'] / 2**20:.1f}",
        f"{row['first_call_s']:.1f}",
        num(row["loss_gap"], "{:.1e}"),
        num(row["loss_gap_eager"], "{:.1e}"),
        num(row.get("aten_calls"), "{:,.0f}"),
        num(row.get("launches"), "{:,.0f}"),
    ]


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    """The targets on the GPU (a CUDA result only), one summary line each."""
    out = []
    for cfg in (r["result"] for r in _results(results, "cuda")):
        ranks = f", {cfg['world']} fake ranks" if cfg.get("fake") else ""
        for a, b, at, x in cfg["targets"]:
            measured = "not measured" if x is None else f"{x:.2f}x"
            met = "-" if x is None else "yes" if x <= at else "**no**"
            out.append([f"GPU step {cfg['name']}{ranks}: {a}", f"<= {at}x {b}", measured, met])
    return out


def _targets(targets: list) -> str:
    """The targets, as measured (median per-round ratios)."""
    said = [
        f"{a} / {b}: " + ("not measured" if x is None else f"**{x:.2f}x**")
        + f" (target <= {at}x{'' if x is None else ', met' if x <= at else ', **not met**'})"
        for a, b, at, x in targets
    ]  # fmt: skip
    return "Targets: " + "; ".join(said) + "."


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="a tiny model, 3 rounds (CPU: < 1 min)")
    ap.add_argument("--configs", help=f"comma-separated, of {[*CONFIGS, *QUICK]}")
    ap.add_argument("--variants", help="labels separated by ',' (default: all)")
    ap.add_argument("--rounds", type=int, help="timed steps per variant (default 20; quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed alternating steps (default 5; quick 1)")
    ap.add_argument("--peak-tflops", type=float, help="bf16 peak (default: 989, H100 SXM, on CUDA)")
    ap.add_argument("--backend", help="torch.compile backend (default inductor; quick aot_eager)")
    ap.add_argument("--out", type=Path, help="results folder")
    ap.add_argument("--fake-world", type=int, default=0,
                    help="N > 1: a fake process group of N ranks on the device (this process "
                         "is rank 0): one rank's work of an N-rank job")  # fmt: skip
    ap.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                    help="skip AdamW alone on the shards")  # fmt: skip
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    known = QUICK if args.quick else CONFIGS
    names = args.configs.split(",") if args.configs else list(known)
    unknown = [n for n in names if n not in {**CONFIGS, **QUICK}]
    if unknown:
        ap.error(f"unknown --configs {unknown}; known: {[*CONFIGS, *QUICK]}")
    # labels hold ", " ("funcshard, CUDA graph"): split at commas not followed by a space
    args.variants = re.split(r",(?! )", args.variants) if args.variants else None
    labels = variants(device, "")
    if args.variants and set(args.variants) - set(labels):
        ap.error(
            f"unknown --variants {sorted(set(args.variants) - set(labels))}; known: {[*labels]}"
        )
    args.rounds = args.rounds or (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    if args.peak_tflops is None and device.type == "cuda":
        args.peak_tflops = 989.0
    out = args.out or (harness.RESULTS / "quick" if args.quick else harness.RESULTS)
    paths = []
    suffix = f"-fake{args.fake_world}" if args.fake_world else ""
    with _world(device, args.fake_world) as mesh:
        for name in names:
            t0, before = time.perf_counter(), harness.machine(device)
            result = measure(name, {**CONFIGS, **QUICK}[name], mesh, device, args)
            info = {
                "part": "gpu",
                "quick": args.quick,
                "machine": before,
                "load_average_after": harness.machine(device)["load_average"],
                "seconds": time.perf_counter() - t0,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "result": result | {"peak_tflops": args.peak_tflops, "backend": args.backend},
            }
            paths.append(harness.write(f"gpu-{device.type}-{name}{suffix}", info, out))
            print(section({paths[-1].stem: info}))
            print(f"[gpu] {name}: {info['seconds']:.0f} s -> {paths[-1]}", flush=True)
    return paths


@contextlib.contextmanager
def _world(device: torch.device, fake: int = 0):
    """One rank -- NCCL on CUDA device 0, gloo on CPU -- and its mesh; with ``fake`` > 1, rank
    0 of a fake process group of ``fake`` ranks on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh

    if fake:
        from .fake import fake_world

        if device.type == "cuda":
            torch.cuda.set_device(0)
        with fake_world(fake, device=device.type) as mesh:
            yield mesh
        return

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh(device.type, (1,))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
