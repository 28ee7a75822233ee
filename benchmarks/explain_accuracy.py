"""Part ``explain``: how close ``fs.explain``'s prediction is to the real step, per rank.

For each configuration (a model, its dtype, recompute, reshard after forward) the same
``apply``, parameters, batch, loss and optimizer go to ``fs.explain`` and to real training
steps on the ranks; then:

- **peak**: the real step's peak on the calling thread (``peak_bytes(this_thread=True)``, after
  two warm-up steps, as ``memory.py``'s *own peak*) plus what is resident before it (the local
  shards, the optimizer state, the batch and the buffers), against ``peak_bytes``;
- **collectives**: ``(kind, in bytes, out bytes) -> count`` of the ``c10d::`` operators in
  ``torch.profiler``'s record of one real step (``record_shapes``), against
  ``Explanation.collectives``; they must be equal;
- **step time**: the median of timed steps (the slowest rank's, see [Note: fair timing]) against
  ``predicted_step_s``, with ``fs.Hardware.measure(group)`` calibrated on the ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

from . import harness
from .workloads import LlamaBlock, MLPBlock, meta_llama

# c10d's operators (as the profiler names them) by kind: in-place ones take (output, input)
# (all-reduce: tensors), functional ones (input, ...) and return their output
_KINDS = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_reduce": "all_reduce",
}
_SIZES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, how it is grouped, one rank's batch and the loss ``loss(out, *batch)``."""

    name: str
    build: Callable[[], nn.Module]
    group_types: tuple[type[nn.Module], ...]
    batch: Callable[[int], tuple[torch.Tensor, ...]]  # rank -> inputs
    loss: Callable[..., torch.Tensor]
    param_dtype: torch.dtype | None = None
    recompute: bool = False
    reshard_after_forward: bool = True

    @property
    def label(self) -> str:
        return (
            f"{self.name}, {harness.dtype_name(self.param_dtype)}"
            + (", recompute" if self.recompute else "")
            + ("" if self.reshard_after_forward else ", no reshard")
        )


def _mse(out: torch.Tensor, *batch: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _next_token(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def mlp_case(blocks: int = 4, width: int = 256, rows: int = 256, **options: Any) -> Case:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[MLPBlock(width, 4 * width) for _ in range(blocks)])

    def batch(rank: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(rows, width, generator=torch.Generator().manual_seed(rank)),)

    return Case(f"mlp {blocks}x{width}, {rows} rows", build, (MLPBlock,), batch, _mse, **options)


def lm_case(**options: Any) -> Case:
    """``examples/train_lm.py``'s model at its defaults (width 128, 4 blocks, context 64), its
    plan (a group per block) and its loss (next-token cross-entropy); 8 sequences per rank."""
    from examples import train_lm

    cfg = train_lm.Config()  # the defaults

    def build() -> nn.Module:
        torch.manual_seed(0)
        return train_lm.LM(256, cfg.width, cfg.heads, cfg.depth, cfg.context)

    def batch(rank: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(rank)
        return (torch.randint(0, 256, (8, cfg.context), generator=g),)

    def loss(logits, tokens):  # the example's lm_loss, on (inputs, targets) = tokens shifted
        return _next_token(logits[:, :-1], tokens[:, 1:])

    return Case("train_lm", build, (train_lm.Block,), batch, loss, **options)


def llama_case(**options: Any) -> Case:
    """The Llama benchmark models' blocks (``workloads.meta_llama``), at a CPU size."""
    layers, width, hidden, vocab, kv = 2, 256, 688, 512, 128

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = meta_llama(layers, width, hidden, vocab, kv).to_empty(device="cpu")
        for p in model.parameters():
            nn.init.normal_(p, std=0.02)
        return model

    def batch(rank: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(rank)
        return (torch.randint(0, vocab, (2, 64), generator=g),)

    def loss(logits, tokens):
        return _next_token(logits[:, :-1], tokens[:, 1:])

    return Case("llama 2x256", build, (LlamaBlock,), batch, loss, **options)


def hf_case(**options: Any) -> Case:
    """A tiny GPT-2 of ``transformers``, from a config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, attn_implementation="sdpa"
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)

    def batch(rank: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(rank)
        return (torch.randint(0, 512, (4, 64), generator=g),)

    def loss(out, tokens):
        return _next_token(out.logits[:, :-1], tokens[:, 1:])

    return Case("hf gpt2 2x128", build, (GPT2Block,), batch, loss, **options)


def cases(quick: bool) -> list[Case]:
    bf16 = torch.bfloat16
    out = [
        mlp_case(),
        mlp_case(reshard_after_forward=False),
        mlp_case(recompute=True),
        mlp_case(param_dtype=bf16),
        lm_case(),
        lm_case(param_dtype=bf16),
        lm_case(recompute=True),
        lm_case(reshard_after_forward=False),
        llama_case(),
        llama_case(param_dtype=bf16, recompute=True),
        hf_case(),
        hf_case(param_dtype=bf16, reshard_after_forward=False),
    ]
    return out[:2] if quick else out


# ---- one configuration on the ranks --------------------------------------------------------
@dataclasses.dataclass
class Setup:
    apply: Any
    params: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    batch: tuple[torch.Tensor, ...]
    opt: Any
    state: Any
    loss: Callable[..., torch.Tensor]

    def step(self) -> None:
        def loss_fn(p):
            return self.loss(self.apply(p, *self.batch, buffers=self.buffers), *self.batch)

        _, grads = fs.value_and_grad(loss_fn)(self.params)
        self.params, self.state = fs.optim.step(self.opt, self.params, grads, self.state)


def setup(case: Case, mesh) -> Setup:
    model = case.build()
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh)
    plan = fs.plan(
        model,
        fs.policy.by_type(*case.group_types),
        recompute=case.recompute or None,
        reshard_after_forward=case.reshard_after_forward,
    )
    model.to("meta")
    apply = fs.schedule(model, plan, param_dtype=case.param_dtype)
    opt = fs.optim.adamw(1e-3, weight_decay=0.1)
    batch = tuple(  # float inputs in the compute dtype (the model's first matmul takes them)
        t.to(case.param_dtype) if case.param_dtype and t.is_floating_point() else t
        for t in case.batch(dist.get_rank())
    )
    return Setup(apply, sharded, dict(buffers), batch, opt, opt.init(sharded), case.loss)


def resident_bytes(s: Setup) -> int:
    """Bytes of the storages alive before a step: shards, optimizer state, batch, buffers."""
    seen: dict[int, int] = {}
    for t in torch.utils._pytree.tree_leaves((s.params, s.state, s.batch, s.buffers)):
        t = t._local_tensor if isinstance(t, DTensor) else t
        if isinstance(t, torch.Tensor):
            u = t.untyped_storage()
            seen[u.data_ptr()] = u.nbytes()
    return sum(seen.values())


def profiled_collectives(s: Setup) -> dict[tuple[str, int, int], int]:
    """``(kind, in bytes, out bytes) -> count`` of one real step's c10d operators."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        s.step()
    out: dict[tuple[str, int, int], int] = collections.Counter()
    world = dist.get_world_size()
    for e in prof.events():
        kind = _KINDS.get(e.name)
        if kind is None or _inside_collective(e):
            continue
        sizes = [
            sum(math.prod(shape) for shape in _shapes(shapes)) * _SIZES[dt]
            for shapes, dt in zip(e.input_shapes, e.input_dtypes, strict=False)
            if dt in _SIZES and shapes
        ]
        if kind == "all_reduce":
            key = (kind, sizes[0], sizes[0])
        elif e.name.startswith("c10d::"):  # (output, input)
            key = (kind, sizes[1], sizes[0])
        else:  # input, and the output that comes back
            scale = world if kind == "all_gather" else 1 / world
            key = (kind, sizes[0], int(sizes[0] * scale))
        out[key] += 1
    return dict(out)


def _inside_collective(e) -> bool:
    """Whether a collective operator ``e`` runs inside another (a functional collective calls
    the in-place one)."""
    parent = e.cpu_parent
    while parent is not None:
        if parent.name in _KINDS:
            return True
        parent = parent.cpu_parent
    return False


def _shapes(shapes) -> list[list[int]]:
    """A tensor's shape, or a list of tensors' shapes, as a list of shapes."""
    return shapes if shapes and isinstance(shapes[0], list) else [shapes]


def predicted_collectives(e: fs.Explanation) -> dict[tuple[str, int, int], int]:
    out: dict[tuple[str, int, int], int] = collections.Counter()
    for c in e.collectives:
        out[(c.kind, c.in_bytes, c.out_bytes)] += c.count
    return dict(out)


def timed(s: Setup, rounds: int) -> float:
    """Median seconds of ``rounds`` steps (each the slowest rank's)."""
    mine = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        s.step()
        mine.append(time.perf_counter() - t0)
    everyone: list[list[float]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    return statistics.median(max(r[i] for r in everyone) for i in range(rounds))


def measure(case: Case, mesh, hardware: fs.Hardware, rounds: int) -> dict[str, Any]:
    s = setup(case, mesh)
    explained = fs.explain(
        s.apply,
        s.params,
        *s.batch,
        optimizer=s.opt,
        buffers=s.buffers,
        loss=s.loss,
        hardware=hardware,
    )
    for _ in range(2):
        s.step()
    gc.collect()
    own, _ = peak_bytes(s.step, this_thread=True)
    measured = own + resident_bytes(s)
    profiled = profiled_collectives(s)
    predicted = predicted_collectives(explained)
    seconds = timed(s, rounds)
    peaks: list[tuple[int, int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(peaks, (measured, explained.peak_bytes))
    return {
        "configuration": case.label,
        "measured_peak": [m for m, _ in peaks],
        "predicted_peak": [p for _, p in peaks],
        "peak_error": max((p - m) / m for m, p in peaks),
        "worst_peak_error": max(((p - m) / m for m, p in peaks), key=abs),
        "at_peak": explained.at_peak,
        "peak_at": f"{explained.peak_at.phase} {explained.peak_at.step.op} "
        f"{explained.peak_at.step.group}",
        "collectives_equal": profiled == predicted,
        "collectives": sorted([*k, n] for k, n in predicted.items()),
        "profiled_collectives": sorted([*k, n] for k, n in profiled.items()),
        "measured_step_s": seconds,
        "predicted_step_s": explained.predicted_step_s,
        "step_error": (explained.predicted_step_s - seconds) / seconds,
    }


def run(ctx: harness.Context) -> dict[str, Any]:
    group = ctx.mesh.get_group(0)
    hardware = fs.Hardware.measure(group)
    rows = []
    for case in cases(ctx.quick):
        t0 = time.perf_counter()
        row = measure(case, ctx.mesh, hardware, rounds=3 if ctx.quick else 5)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if ctx.rank == 0:
            print(_line(row), flush=True)
        gc.collect()
    return {
        "rows": rows,
        "hardware": hardware.to_dict(),
    }


def _line(row: dict[str, Any]) -> str:
    return (
        f"  {row['configuration']:<40} peak {max(row['measured_peak']) / 2**20:7.2f} MiB "
        f"predicted {max(row['predicted_peak']) / 2**20:7.2f} MiB "
        f"({100 * row['worst_peak_error']:+.1f}%), collectives "
        f"{'equal' if row['collectives_equal'] else 'DIFFER'}, step "
        f"{1e3 * row['measured_step_s']:.1f} ms predicted {1e3 * row['predicted_step_s']:.1f} ms "
        f"({100 * row['step_error']:+.0f}%)"
    )


# ---- the generated block of BENCHMARKS.md --------------------------------------------------
def section(results: dict[str, Any]) -> str:
    """The generated block of BENCHMARKS.md (``<!-- bench:explain -->``): one table per world
    size."""
    from .tables import MiB, mark, measured, table

    out = []
    for key in sorted(k for k in results if k.startswith("explain-")):
        r = results[key]
        rows = [
            [
                v["configuration"],
                f"{max(v['measured_peak']) / MiB:.2f}",
                f"{max(v['predicted_peak']) / MiB:.2f}",
                f"**{100 * v['worst_peak_error']:+.1f}%**",
                mark(v["collectives_equal"]),
                str(sum(c[-1] for c in v["collectives"])),
                f"{1e3 * v['measured_step_s']:.0f}",
                f"{1e3 * v['predicted_step_s']:.0f}",
                f"{100 * v['step_error']:+.0f}%",
            ]
            for v in r["result"]["rows"]
        ]
        errors = [abs(v["worst_peak_error"]) for v in r["result"]["rows"]]
        steps = sorted(abs(v["step_error"]) for v in r["result"]["rows"])
        out.append(
            f"**{r['world']} ranks**: peak error at most {100 * max(errors):.1f}% "
            f"(median {100 * statistics.median(errors):.1f}%); step-time error median "
            f"{100 * statistics.median(steps):.0f}%, at most {100 * max(steps):.0f}%."
        )
        header = ["configuration", "peak MiB", "predicted", "error", "collectives equal"]
        header += ["collectives", "step ms", "predicted", "error"]
        out.append(table(header, rows))
        out.append(measured(r))
    return "\n\n".join(out) + ("\n" if out else "")
