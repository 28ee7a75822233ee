"""``fs.autoplan`` against a grid of hand-written plans, all measured on 2 gloo ranks (CPU).

For each model, a grid of plans (policies x prefetch x reshard after forward x recompute) is run
for real: step times are the slowest rank's, timed in turn (``harness.alternate``), medians;
peaks are the rank's resident bytes (its parameter shards, optimizer state and inputs) plus the
most ``_profiling.peak_bytes`` sees allocated during one step. For each of two budgets -- loose,
and tight (between the smallest predicted peak and the default plan's, so that recompute or
reshard is needed) -- ``fs.autoplan`` chooses a plan from ``fs.explain``'s predictions (rates
from ``Hardware.measure`` over the ranks' group), which is measured the same way. Reported:
autoplan's measured time over the best grid plan whose *measured* peak fits (target <= 1.05),
and whether autoplan's measured peak is within the budget.

Run: ``PYTHONPATH=. python -m benchmarks.autoplan`` (about 5-10 minutes on 2 cores); writes
``benchmarks/results/autoplan.json`` and prints the markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

from .harness import alternate
from .workloads import LM, Block, MLPBlock

MiB = 2**20
ROUNDS, WARMUP = 9, 2


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], nn.Module]
    block: type[nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, ...]]  # rank -> inputs
    loss: Callable[..., torch.Tensor]  # loss(output, *inputs)


def _tokens(vocab: int, rows: int, seq: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    return lambda rank: (torch.randint(0, vocab, (rows, seq), generator=_gen(rank)),)


def _gen(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(rank)


def _lm_loss(logits, tokens):
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def _gpt2_block() -> type[nn.Module]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


def models() -> list[Model]:
    seeded = lambda f: lambda: (torch.manual_seed(0), f())[1]
    return [
        Model(
            "MLP stack: 8 blocks 128 -> 512 -> 128, 1024 rows per rank",
            seeded(lambda: nn.Sequential(*[MLPBlock(128, 512) for _ in range(8)])),
            MLPBlock,
            lambda rank: (torch.randn(1024, 128, generator=_gen(rank)),),
            lambda out, x: out.square().mean(),
        ),
        Model(
            "transformer (examples/train_lm.py): 4 blocks x 128, vocab 256, 8 x 64 tokens per rank",
            seeded(lambda: LM(256, 128, 4, 4, 64)),
            Block,
            _tokens(256, 8, 64),
            _lm_loss,
        ),
        Model(
            "Hugging Face GPT-2 from config: 4 layers x 128, vocab 512, 8 x 64 tokens per rank",
            seeded(_gpt2),
            _gpt2_block(),
            _tokens(512, 8, 64),
            _lm_loss,
        ),
    ]


def grid(module: nn.Module, block: type[nn.Module]) -> dict[str, fs.Plan]:
    """Hand-written plans: per block x prefetch x reshard x recompute, merged pairs, one group."""
    out = {}
    policy = fs.policy.by_type(block)
    for f in (0, 1, 2):
        for r in (True, False):
            for rc, rc_name in ((None, "none"), (2, "every 2nd"), (True, "all")):
                p = fs.plan(
                    module, policy, prefetch=f, backward_prefetch=f, reshard_after_forward=r,
                    recompute=rc,
                )  # fmt: skip
                out[f"per block, prefetch {f}, reshard {r}, recompute {rc_name}"] = p
    sizes = fs.extract(module)[0]
    per_block = max(
        sum(p.numel() * 4 for p in m.parameters()) for m in module.modules() if type(m) is block
    )
    for r in (True, False):
        merged = fs.merge_groups(
            fs.plan(module, policy, reshard_after_forward=r), sizes, 2 * per_block
        )
        out[f"block pairs, prefetch 1, reshard {r}"] = merged
    out["one group"] = fs.plan(module)
    return out


def _resident(*trees: Any) -> int:
    seen, total = set(), 0
    for t in (x for tree in trees for x in _leaves(tree)):
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.untyped_storage().data_ptr()
        if key not in seen and local.device.type != "meta":
            seen.add(key)
            total += local.untyped_storage().nbytes()
    return total


def _leaves(tree: Any) -> list[torch.Tensor]:
    import optree

    return [x for x in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(x, torch.Tensor)]


def _steps(model: Model, module, plans: dict[str, fs.Plan], params, buffers, batch, mesh):
    """{label: (step function, its shards, its optimizer state)} of each plan."""
    opt = fs.optim.adamw(1e-4)
    out = {}
    for label, plan in plans.items():
        apply = fs.schedule(module, plan)
        sharded = fs.shard(params, mesh)
        state = opt.init(sharded)
        loss_fn = lambda p, apply=apply: model.loss(apply(p, *batch, buffers=buffers), *batch)

        def step(i=0, sharded=sharded, state=state, loss_fn=loss_fn):
            _, grads = fs.value_and_grad(loss_fn)(sharded)
            fs.optim.step(opt, sharded, grads, state)

        out[label] = (step, sharded, state)
    return out


def _times(model, module, plans, params, buffers, batch, mesh) -> dict[str, float]:
    """{label: median step seconds, the slowest rank's} (collective, on the real group)."""
    steps = {k: v[0] for k, v in _steps(model, module, plans, params, buffers, batch, mesh).items()}
    times = alternate(steps, rounds=ROUNDS, warmup=WARMUP, device=torch.device("cpu"))
    return {k: statistics.median(v) for k, v in times.items()}


def _peaks(model: Model, plans: dict[str, fs.Plan]) -> dict[str, int]:
    """{label: rank 0's measured peak bytes}: resident bytes (shards, optimizer state, inputs,
    buffers) plus the most allocated at once during one real step (after a warm-up step).

    [Note: peaks measured over a fake process group]
    Run in one process over ``benchmarks.fake``'s process group: real tensors, the real
    allocator and schedule, collectives that move nothing (their outputs are allocated as on
    gloo). Under the profiler two gloo ranks could stall each other past gloo's timeout on this
    loaded 2-core machine; the fake group has no partner to wait for. Not counted: gloo's
    worker-thread scratch buffers."""
    from .fake import fake_world

    module = model.build()
    params, buffers = fs.extract(module)
    batch = model.batch(0)
    out = {}
    with fake_world(2) as mesh:
        for label, (step, sharded, state) in _steps(
            model, module, plans, params, buffers, batch, mesh
        ).items():
            step()
            during, _ = peak_bytes(step)
            out[label] = _resident(sharded, state, batch, buffers) + during
    return out


def _same_program(a: fs.Plan, b: fs.Plan) -> bool:
    """Whether the scheduler runs ``a`` and ``b`` alike: the same groups and the same steps."""
    return a.groups == b.groups and a.forward == b.forward and a.backward == b.backward


def per_rank() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    hardware = fs.Hardware.measure(dist.group.WORLD)
    results = []
    for model in models():
        module = model.build()
        params, buffers = fs.extract(module)
        batch = model.batch(rank)
        plans = grid(module, model.block)
        explained = {}  # the grid's predictions, for the tight budget and the table
        on_meta = fs.shard(_meta(params), mesh)
        for label, p in plans.items():
            e = fs.explain(
                fs.schedule(module, p), on_meta, *batch,
                optimizer=fs.optim.adamw(1e-4), buffers=buffers, loss=model.loss, hardware=hardware,
            )  # fmt: skip
            explained[label] = (e.peak_bytes, e.predicted_step_s)
        default = explained["per block, prefetch 1, reshard True, recompute none"][0]
        lowest = min(peak for peak, _ in explained.values())
        budgets = {"loose": 4 * default, "tight": int(lowest + 0.5 * (default - lowest))}
        chosen = {}
        for name, budget in budgets.items():
            t0 = time.perf_counter()
            got = fs.autoplan(
                module, mesh, *batch, memory_budget=budget, optimizer=fs.optim.adamw(1e-4),
                loss=model.loss, hardware=hardware, explain=True,
            )  # fmt: skip
            search_s = time.perf_counter() - t0
            # the same program as a grid plan -- its groups and steps: a backward prefetch
            # depth with nothing to gather in backward changes nothing -- measured once
            label = next(
                (k for k, p in plans.items() if _same_program(p, got.plan)), f"autoplan ({name})"
            )
            chosen[name] = (label, got, search_s)
            plans[label] = got.plan
        times = _times(model, module, plans, params, buffers, batch, mesh)
        chosen = {
            k: (label, got.plan.to_json(), _summary(got), s)
            for k, (label, got, s) in chosen.items()
        }
        results.append((times, plans, budgets, chosen, explained))
    return results


def _summary(got: fs.Autoplanned) -> dict[str, Any]:
    return {
        "description": next(t.description for t in got.tried if t.plan == got.plan),
        "explained": len(got.tried),
        "predicted_peak": got.explanation.peak_bytes,
        "predicted_s": got.explanation.predicted_step_s,
    }


def _meta(params):
    return {
        k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
        for k, v in params.items()
    }


def _rows(model, times, peaks, budgets, chosen, explained) -> dict[str, Any]:
    measured = {k: (times[k], peaks[k]) for k in times}
    rows = []
    for name, budget in budgets.items():
        label, _, got, search_s = chosen[name]
        t_auto, peak_auto = measured[label]
        grid_fit = {
            k: v for k, v in measured.items() if not k.startswith("autoplan") and v[1] <= budget
        }
        best = min(grid_fit, key=lambda k: grid_fit[k][0]) if grid_fit else None
        rows.append(
            {
                "budget": name,
                "budget_bytes": budget,
                "autoplan": got["description"],
                "explained": got["explained"],
                "search_s": search_s,
                "predicted_peak": got["predicted_peak"],
                "predicted_s": got["predicted_s"],
                "measured_s": t_auto,
                "measured_peak": peak_auto,
                "best_grid": best,
                "best_grid_s": grid_fit[best][0] if best else None,
                "best_grid_peak": grid_fit[best][1] if best else None,
                "grid_fitting": len(grid_fit),
                "ratio": t_auto / grid_fit[best][0] if best else None,
                "fits": peak_auto <= budget,
            }
        )
    grid = {k: {"measured": v, "explained": explained.get(k)} for k, v in measured.items()}
    return {"model": model.name, "rows": rows, "grid": grid}


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| model | budget MiB | autoplan's plan | explained | search s | autoplan ms "
        "| best fitting grid plan | grid ms | autoplan / best grid | autoplan peak MiB "
        "(predicted) | within budget |\n|" + "---|" * 11
    )
    lines = [head]
    for r in results:
        for row in r["rows"]:
            lines.append(
                f"| {r['model'].split(':')[0]} | {row['budget']} {row['budget_bytes'] / MiB:.1f} "
                f"| {row['autoplan'].replace('|', '/')} | {row['explained']} "
                f"| {row['search_s']:.1f} "
                f"| {row['measured_s'] * 1e3:.1f} | {row['best_grid'] or 'none fits'} "
                f"| {row['best_grid_s'] * 1e3 if row['best_grid_s'] else float('nan'):.1f} "
                f"| {row['ratio'] or float('nan'):.2f} "
                f"| {row['measured_peak'] / MiB:.1f} ({row['predicted_peak'] / MiB:.1f}) "
                f"| {'yes' if row['fits'] else '**no**'} |"
            )
    return "\n".join(lines)


def main() -> None:
    t0 = time.perf_counter()
    ranked = fs.testing.run(per_rank, world=2, timeout=1200)[0]
    results = []
    for model, (times, plans, budgets, chosen, explained) in zip(models(), ranked, strict=True):
        peaks = _peaks(model, plans)
        results.append(_rows(model, times, peaks, budgets, chosen, explained))
    out = Path(__file__).parent / "results" / "autoplan.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"\n{time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
