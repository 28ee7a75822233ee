"""Part ``gpu_8b``: Llama-3.1-8B's training step, one rank of an 8-rank job on one GPU, against
torchtitan's published numbers (``docs/performance.md``, Table 1: FSDP over 8 H100s, local batch
2 x 8192, selective activation checkpointing, bf16).

The model (``host.Llama``): width 4096, 32 blocks, 32 heads sharing 8 key-value heads, SwiGLU
14336, vocabulary 128256, rotary embeddings, an untied head -- 8.03B parameters. Built on the
meta device and initialised straight into shards (``fs.materialize``, once; every variant starts
from copies of those shards), as rank 0 of 8 on the fake process group (``fake.py``: collectives
return at once, moving nothing; every other part of the rank's step is real). fp32 master
weights, bf16 compute, fp32 gradient reduction, AdamW's fused kernel; tokens ``(2, 8192)``,
cross-entropy of the float32 logits. The variants run in sets, one after another (what a set
keeps on the device -- 11.2 GiB of shards and AdamW state per variant, CUDA graphs' pools, one
step's temporaries -- fits an H200's 139 GiB), most telling first; within a set they alternate
step by step ([Note: fair timing] in ``harness``):

- ``full AC``, every block recomputed in backward: FSDP2 (``checkpoint_wrapper`` per block),
  FSDP2 + compile per block (torchtitan's order: checkpoint, compile, ``fully_shard``), funcshard
  eager, ``fs.cuda_graph`` of its whole step, its whole step under ``torch.compile``;
- ``selective AC``: FSDP2 + compile per block with torchtitan's selective checkpointing by
  operator ([Note: torchtitan's selective activation checkpointing] in ``variants``), funcshard
  eager with every block recomputed but the last ``KEEP`` (``fs.plan(..., recompute=[names])``:
  a plan recomputes whole groups, not operators);
- ``compiled``: funcshard's whole step compiled by ``fs.jit`` with that selective plan, and
  compiled with every block recomputed and captured (``fs.cuda_graph(fs.jit(step))``).

Per variant: step time and its ratio to the set's FSDP2 + compile per block, tokens/s per GPU,
MFU (``flop_per_token``: torchtitan's count), peak allocated and reserved memory
(``_profile_step``), the first step's seconds (the compile, with the process's caches: the
first compile of a graph is cold, a later set's compile of the same graph finds its kernels;
a graph's capture), GPU busy (kernel time / step time). The losses are not compared: the fake
group's gathers return whatever their buffers held. Exposed communication for 8 real ranks on
NVLink comes from ``fs.explain`` (``gpu_8b_explain``), beside each row in the report. The
results, ``gpu8b-<device>.json``, are rewritten after each variant's first steps and after each
set: a run cut short keeps what it finished.

    python -m benchmarks.gpu_8b                          # on the GPU (about 5 minutes)
    python -m benchmarks.gpu_8b --sets "full AC"         # one set
    python -m benchmarks.gpu_8b --quick --device cpu     # tiny shapes, gloo, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import time
from pathlib import Path
from typing import Any

import torch

import funcshard as fs
from funcshard._trees._dtensor import placed_like

from . import compile as compiled
from . import gpu, harness
from .fake import fake_world
from .host import Llama, LlamaBlock
from .variants import OPS, VARIANTS, Options, Trainer
from .workloads import Workload, _lm_loss

DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama's shapes and one rank's batch (``batch`` sequences of ``seq`` tokens) in a job
    of ``world`` ranks."""

    width: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    batch: int
    seq: int
    world: int

    def describe(self) -> str:
        return (
            f"d={self.width}, {self.layers} blocks, {self.heads} heads ({self.kv_heads} for keys "
            f"and values), SwiGLU {self.hidden}, vocab {self.vocab}, batch {self.batch}x"
            f"{self.seq} per rank, rank 0 of {self.world}"
        )


LLAMA_8B = Shape(4096, 32, 32, 8, 14336, 128256, batch=2, seq=8192, world=8)
TINY = Shape(64, 4, 4, 2, 192, 256, batch=2, seq=64, world=8)
# blocks that keep their activations in the selective form (the last ones: their backward runs
# first and frees them first); 8B: the most whose predicted peak stays within 77 GiB
# (BENCHMARKS.md section 13)
KEEP = {LLAMA_8B: 10, TINY: 1}
# torchtitan, Table 1 (8 H100s, Llama 3.1 8B, local batch 2 x 8192, selective AC, bf16):
# tokens/s per GPU and memory (GiB)
TORCHTITAN = {
    "FSDP2": (5762, 82.4),
    "FSDP2 + torch.compile": (6667, 77.0),
    "FSDP2 + torch.compile + Float8": (8532, 76.8),
}
TARGET_TOKENS, TARGET_GIB = 7300, 77.0  # 1.1x torchtitan's FSDP2 + compile, within its memory

FULL, BLOCKS = "full", "blocks"  # the recompute forms (and OPS: torchtitan's, FSDP2 only)
BASELINE = "FSDP2 + compile per block"
# the sets, run one after another (what one set keeps on the device: its variants' shards and
# AdamW state, 11.2 GiB each, CUDA graphs' pools, one step's temporaries -- within an H200's
# 139 GiB): label -> (variants.VARIANTS key, recompute form). A variant registered in VARIANTS
# (an fs.jit step, say) plugs in as one line of a set here.
SETS: dict[str, dict[str, tuple[str, str]]] = {
    "full AC": {
        "FSDP2": ("fsdp2", FULL),
        BASELINE: ("fsdp2 + compile per block", FULL),
        "funcshard": ("funcshard", FULL),
        "funcshard, CUDA graph": ("funcshard + fs.cuda_graph", FULL),
        "funcshard, compiled": ("funcshard + compile", FULL),
    },
    "selective AC": {
        BASELINE: ("fsdp2 + compile per block", OPS),
        "funcshard": ("funcshard", BLOCKS),
    },
    "compiled": {
        "funcshard, fs.jit": ("funcshard + fs.jit", BLOCKS),
        "funcshard, fs.jit, CUDA graph": ("funcshard + fs.jit + fs.cuda_graph", FULL),
    },
}
GRAPHED = ("funcshard + fs.cuda_graph", "funcshard + fs.jit + fs.cuda_graph")


def model(s: Shape) -> Llama:
    """The Llama of ``s`` on the meta device, its rotary tables in the compute dtype."""
    with torch.device("meta"):
        m = Llama(s.layers, s.width, s.heads, s.vocab, s.seq, hidden=s.hidden, kv_heads=s.kv_heads)
    m.cos, m.sin = m.cos.to(DTYPE), m.sin.to(DTYPE)
    return m


def parameters(s: Shape) -> int:
    return sum(p.numel() for p in model(s).parameters())


def flop_per_token(s: Shape) -> int:
    """torchtitan's model FLOPs per token: 6 per parameter outside the embedding table (2 in
    forward, 4 in backward; a lookup does no matmul) and 12 x layers x heads x head width x
    sequence for attention's two matmuls, every position counted (the causal mask skips half
    of them: the convention counts them anyway). A recompute's FLOPs are not counted."""
    attention = 12 * s.layers * s.heads * (s.width // s.heads) * s.seq
    return 6 * (parameters(s) - s.vocab * s.width) + attention


def mfu(tokens_per_s: float, s: Shape, peak_tflops: float) -> float:
    return flop_per_token(s) * tokens_per_s / (peak_tflops * 1e12)


def recompute(form: str, s: Shape) -> bool | tuple[str, ...] | str:
    """``Options.recompute`` of a form: every block, all but the last ``KEEP[s]``, or OPS."""
    if form == BLOCKS:
        return tuple(f"blocks.{i}" for i in range(s.layers - KEEP[s]))
    return True if form == FULL else form


def options(form: str, s: Shape, backend: str) -> Options:
    return Options(param_dtype=DTYPE, fused=True, recompute=recompute(form, s),
                   compile_backend=backend)  # fmt: skip


class Initial:
    """``Workload.shards``: ``fs.materialize`` of the model once (``prepare``, or the first
    call; ``seconds``), then a copy of those shards and buffers for each call; ``clear()`` drops
    the kept ones."""

    def __init__(self) -> None:
        self.kept: tuple[dict, dict] | None = None
        self.seconds = 0.0

    def prepare(self, meta: torch.nn.Module, mesh) -> None:
        if self.kept is None:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            self.kept = fs.materialize(meta, mesh)
            harness.sync(torch.device(mesh.device_type))
            self.seconds = time.perf_counter() - t0

    def __call__(self, meta: torch.nn.Module, mesh) -> tuple[dict, dict]:
        self.prepare(meta, mesh)
        params, buffers = self.kept
        copy = {k: placed_like(v.to_local().clone(), v) for k, v in params.items()}
        return copy, {k: v.clone() for k, v in buffers.items()}

    def clear(self) -> None:
        self.kept = None


def workload(s: Shape, device: torch.device, initial: Initial) -> Workload:
    def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, s.vocab, (s.batch, s.seq), generator=g).to(device),)

    return Workload("Llama-3.1-8B", s.describe(), lambda: model(s), (LlamaBlock,), batch,
                    _lm_loss, shards=initial)  # fmt: skip


# ------------------------------------------------------------------------------ measuring


def _profile_step(trainer: Trainer, row: dict, batch, device: torch.device) -> None:
    """One step's kernel time (``gpu._kernel_ms``) and, around it, peak memory into ``row``:
    ``peak_bytes`` (what the variant keeps between steps + the most its step allocates above
    that + a CUDA graph's pool beyond its live tensors, as ``gpu._peak_bytes``) and
    ``reserved_bytes`` (what it keeps + the segments its step adds to an emptied cache + the
    pool). CPU: ``gpu._peak_bytes`` (the allocator's events), no kernel time."""
    row.update(gpu._pool(trainer))
    if device.type != "cuda":
        row["peak_bytes"] = gpu._peak_bytes(trainer, row, batch, device)
        row["kernel_ms"] = None
        return
    harness.sync(device)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    row["kernel_ms"] = gpu._kernel_ms(trainer, [batch], device)
    kept = row["resident_bytes"] + row["pool"]
    row["peak_bytes"] = kept + torch.cuda.max_memory_allocated() - allocated
    row["reserved_bytes"] = kept + torch.cuda.max_memory_reserved() - reserved


def measure_set(
    name: str, s: Shape, w: Workload, mesh, device: torch.device, args, save
) -> dict[str, dict[str, Any]]:
    """The variants of set ``name``: each built from the same initial shards, its first step
    (a CUDA graph's: its two warm-up calls and its capture) and one profiled step
    (``_profile_step``); then all alternating, ``args.warmup`` + ``args.rounds`` steps each. A
    row per variant (measured, skipped or failed: ``gpu._failure``); ``save(rows)`` after each
    variant's first steps and at the end."""
    batches = [w.batch(i, 0) for i in range(4 + args.warmup + args.rounds)]
    rows: dict[str, dict[str, Any]] = {}
    trainers: dict[str, Trainer] = {}
    w.shards.prepare(w.build(), mesh)  # before any variant's memory is counted
    for label, (key, form) in SETS[name].items():
        if args.variants and label not in args.variants:
            continue
        rows[label] = {"variant": key, "recompute": form}
        if key in GRAPHED and device.type != "cuda":
            rows[label]["skipped"] = "CUDA graphs need a CUDA device (--device cuda)"
            continue
        first = 3 if key in GRAPHED else 1  # a graph's: 2 warm-up calls and the capture
        phase = "build and first steps"
        try:
            o = options(form, s, args.backend)
            trainer, built = gpu._prologue(w, mesh, VARIANTS[key], o, batches[:first], device,
                                           cold=False)  # fmt: skip
            rows[label].update(built)
            phase = "profiling"
            _profile_step(trainer, rows[label], batches[first], device)
            trainers[label] = trainer
        except Exception as e:  # recorded, never fatal to the others
            rows[label].update(gpu._failure(e, phase))
        trainer = None
        gc.collect()
        print(f"[gpu_8b] {name}: {label}: {gpu._short(rows[label])}", flush=True)
        save(rows)
    w.shards.clear()
    if trainers:
        _timed(trainers, rows, batches[4:], s, device, args)
    trainers.clear()
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save(rows)
    return rows


def _timed(trainers, rows, batches, s: Shape, device: torch.device, args) -> None:
    """The variants alternating (``gpu._time``): step time, its ratio to the set's baseline
    (``x_baseline``), tokens/s per GPU, MFU and GPU busy into ``rows``."""
    losses = gpu._time(trainers, rows, batches, device, args)
    base = [(label, BASELINE, 1.0) for label in trainers if label != BASELINE]
    for label, _, _, x in gpu._ratios(rows, losses, base, firsts=()):
        rows[label]["x_baseline"] = x
    for row in rows.values():
        if "ms" in row:
            row["tokens_per_s"] = s.batch * s.seq / (row["ms"] / 1e3)
            row["mfu"] = mfu(row["tokens_per_s"], s, args.peak_tflops) if args.peak_tflops else None
            row["busy"] = None if row.get("kernel_ms") is None else row["kernel_ms"] / row["ms"]


def run(args) -> Path:
    """Every set of ``args.sets``; the results rewritten after each."""
    device = torch.device(args.device)
    s = TINY if args.quick else LLAMA_8B
    initial = Initial()
    w = workload(s, device, initial)
    result: dict[str, Any] = {
        "shape": dataclasses.asdict(s),
        "description": s.describe(),
        "parameters": parameters(s),
        "flop_per_token": flop_per_token(s),
        "keep": KEEP[s],
        "peak_tflops": args.peak_tflops,
        "backend": args.backend,
        "sets": {},
        "set_seconds": {},
    }
    info = {"part": "gpu_8b", "quick": args.quick, "machine": harness.machine(device),
            "rounds": args.rounds, "warmup": args.warmup, "result": result}  # fmt: skip
    path = Path()
    if device.type == "cuda":
        torch.cuda.set_device(0)
    try:  # paid by no variant: [Note: the compiler's start-up is nobody's] in compile.py
        result["compiler_start_s"] = compiled.warm_compiler(args.backend, device.type)
    except Exception as e:  # the variants that compile will say what fails
        result["compiler_start_s"] = gpu._failure(e, "compiler start-up")["error"]
    with fake_world(s.world, device=device.type) as mesh:
        for name in args.sets:
            t0 = time.perf_counter()

            def save(rows: dict, name: str = name, t0: float = t0) -> Path:
                result["sets"][name] = rows
                result["set_seconds"][name] = time.perf_counter() - t0
                result["materialize_s"] = initial.seconds
                info["load_average_after"] = harness.machine(device)["load_average"]
                return harness.write(f"gpu8b-{device.type}", info, args.out)

            measure_set(name, s, w, mesh, device, args, save)
            path = save(result["sets"][name])
            print(f"[gpu_8b] {name}: {result['set_seconds'][name]:.0f} s -> {path}", flush=True)
    from .gpu_8b_report import section

    print(section({path.stem: info}))
    return path


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU: about a minute)")
    ap.add_argument("--sets", help=f"comma-separated, of {list(SETS)} (default: all)")
    ap.add_argument("--variants", help="labels separated by ',' (default: all of each set)")
    ap.add_argument("--rounds", type=int, default=2, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=0, help="untimed alternating steps (after "
                    "each variant's first 2-3 steps)")  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, help="bf16 peak (default: 989 on CUDA)")
    ap.add_argument("--backend", help="torch.compile backend (default inductor; quick aot_eager)")
    ap.add_argument("--out", type=Path, help="results folder")
    args = ap.parse_args(argv)
    args.sets = args.sets.split(",") if args.sets else list(SETS)
    if set(args.sets) - set(SETS):
        ap.error(f"unknown --sets {sorted(set(args.sets) - set(SETS))}; known: {list(SETS)}")
    labels = {label for variants in SETS.values() for label in variants}
    args.variants = re.split(r",(?! )", args.variants) if args.variants else None
    if args.variants and set(args.variants) - labels:
        ap.error(f"unknown --variants {sorted(set(args.variants) - labels)}; known: {labels}")
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 989.0
    args.out = args.out or (harness.RESULTS / "quick" if args.quick else harness.RESULTS)
    return run(args)


if __name__ == "__main__":
    main()
