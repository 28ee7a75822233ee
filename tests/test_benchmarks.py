"""The benchmark suite's own arithmetic (memory categories, the communication lower bound, plan
windows, interval overlap, the report's markers) and a smoke run of its parts on 2 ranks.
No timing is asserted: performance numbers live in BENCHMARKS.md."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from benchmarks import (
    comms,
    gpu,
    harness,
    memory,
    overhead,
    recompute,
    report,
    scale,
    step_time,
    timeline,
)
from benchmarks import compile as compiled
from benchmarks.memory import CATEGORIES, Event
from benchmarks.variants import VARIANTS, Options, module_groups, plan_for
from benchmarks.workloads import linears, transformer

from _mesh import mesh

MAIN, GLOO = 1, 2


def test_memory_categories_follow_allocations_by_address():
    events = [
        Event(1, ptr=10, size=100, thread=MAIN),  # activation
        Event(2, ptr=20, size=50, thread=MAIN, comm=True),  # unsharded parameters
        Event(3, ptr=30, size=70, thread=GLOO),  # gloo scratch
        Event(4, ptr=30, size=-70, thread=GLOO),
        Event(5, ptr=40, size=8, thread=MAIN),  # the gradient (alive when backward ends)
        Event(6, ptr=20, size=-50, thread=MAIN),
        Event(7, ptr=10, size=-100, thread=GLOO),  # freed by another thread: still the main's
        Event(8, ptr=99, size=-5, thread=MAIN),  # allocated before the step
        Event(9, ptr=50, size=30, thread=MAIN),  # after backward (optimizer temporary)
    ]
    resident = {"parameters": 1000, "optimizer state": 2000}
    r = memory.account(events, main=MAIN, gradients={40, 50}, backward_end=8, resident=resident)
    # all threads: highest at t=3 (activation + unsharded + scratch)
    assert r["peak_all"] == 3000 + 100 + 50 + 70
    assert r["at_peak_all"] == dict.fromkeys(CATEGORIES, 0) | resident | {
        "activations + temporaries": 100,
        "unsharded parameters + comm. buffers": 50,
        "gloo threads": 70,
    }
    # own thread: highest at t=5 (activation + unsharded + gradient), scratch left out
    assert r["peak_own"] == 3000 + 100 + 50 + 8
    assert r["at_peak_own"]["gradients"] == 8 and "gloo threads" not in r["at_peak_own"]
    for key in ("all", "own"):
        assert sum(r[f"at_peak_{key}"].values()) == r[f"peak_{key}"]


def test_memory_gradient_address_reused_after_a_temporary():
    events = [
        Event(1, ptr=40, size=64, thread=MAIN),  # a temporary at the gradient's future address
        Event(2, ptr=40, size=-64, thread=MAIN),
        Event(3, ptr=40, size=8, thread=MAIN),  # the gradient
    ]
    r = memory.account(events, main=MAIN, gradients={40}, backward_end=5, resident={})
    assert r["peak_own"] == 64 and r["at_peak_own"]["activations + temporaries"] == 64


def test_communication_lower_bound_and_bytes():
    # 2 ranks, 10 fp32 parameters gathered in bf16 twice, reduced in fp32 once: half of each
    assert comms.lower_bound([4, 6], 2, 4, world=2, gathers=2) == 0.5 * (2 * 20 + 40)
    assert comms.lower_bound([4, 6], 4, 4, world=4, gathers=1) == 0.75 * (40 + 40)
    assert comms.sent_bytes("all_gather", 100, 4) == 75
    assert comms.sent_bytes("all_reduce", 100, 2) == 100
    assert comms.kind_of("_allgather_base_") == "all_gather"
    assert comms.kind_of("reduce_scatter_tensor_coalesced_") == "reduce_scatter"
    assert comms.kind_of("wait_tensor") is None
    out, inp = torch.empty(8), torch.empty(4)
    assert comms.buffer_bytes((out, inp, "pg"), None) == 32  # all-gather: the output
    assert comms.buffer_bytes(([out], [[inp]]), None) == 32


def test_plan_window_and_linear_fit():
    model = linears(4, 2).build()
    plan = fs.plan(model, fs.policy.by_type(nn.Linear), prefetch=1, backward_prefetch=1)
    nbytes = {g.name: 10 for g in plan.groups}
    assert scale.window(plan, nbytes) == 20  # the group computing + one prefetched
    assert scale.window(plan.replace(prefetch=0, backward_prefetch=0), nbytes) == 10
    assert scale.linear_fit([1, 2, 3], [3, 5, 7]) == pytest.approx((2, 1, 1))


def test_timeline_intervals():
    assert timeline.merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert timeline.overlap([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)


def test_report_replaces_only_marked_blocks():
    text = "prose\n<!-- bench:step -->\nold\n<!-- /bench:step -->\nmore prose\n"
    assert report.fill(text, {"step": "new table", "other": "x"}) == (
        "prose\n<!-- bench:step -->\nnew table\n<!-- /bench:step -->\nmore prose\n"
    )


def test_fsdp2_groups_of_a_merged_plan():
    w = linears(6, 4)
    merged = plan_for(w, w.build(), Options(merge_bytes=3 * 80))
    assert module_groups(merged) == (("0.0", "1.0", "2.0"), ("3.0", "4.0", "5.0"))


def smoke():
    """The parts' code paths on tiny models (2 rounds; the numbers are not looked at)."""
    ctx = harness.Context(mesh(dist.get_world_size()), torch.device("cpu"), True, 2, 1)
    tiny = linears(4, 8, name="4 x linear 10x10")
    out = {
        "step": step_time.compare(ctx, tiny, Options()),
        "comms": comms.run(ctx),
        "overhead": overhead._table(ctx, tiny),
        "timeline": timeline.run(ctx),
    }
    w = transformer(quick=True)
    out["accounts"] = {}
    for name in ("fsdp2", "funcshard"):
        trainer = VARIANTS[name](w, ctx.mesh, Options())
        trainer.step(w.batch(0, ctx.rank))
        out["accounts"][name] = memory.profile_step(trainer, w.batch(1, ctx.rank), ctx.device)
    return json.loads(json.dumps(out, default=str))


def test_smoke_parts_on_two_ranks(world2):
    for r in world2.run(smoke):
        assert r["step"]["funcshard"]["loss_gap"] < 1e-5  # both frameworks train the same
        assert r["step"]["funcshard"]["rounds"] == 2
        for row in r["comms"]["rows"]:  # the same collectives as FSDP2, within the bound
            assert row["funcshard"]["collectives"] == row["fsdp2"]["collectives"]
            assert row["funcshard"]["x_bound"] == pytest.approx(row["fsdp2"]["x_bound"], rel=1e-2)
        assert list(r["overhead"]["rows"]) == [
            "FSDP2",
            "funcshard",
            "funcshard, merge_groups <= 4 KiB (1 groups)",
            "FSDP2, the same 1 groups",
        ]
        lanes = r["timeline"]["frameworks"]["funcshard"][0]["lanes"]
        assert lanes["compute"] and lanes["all-gather"] and lanes["reduce-scatter"]
        a, b = r["accounts"]["fsdp2"], r["accounts"]["funcshard"]
        for acc in (a, b):
            assert sum(acc["at_peak_all"].values()) == acc["peak_all"] >= acc["peak_own"]
        assert b["at_peak_all"]["optimizer state"] == pytest.approx(
            a["at_peak_all"]["optimizer state"], rel=0.01
        )


def test_compile_report_rows_and_failures():
    row = dict(ms=10.0, ratio=0.5, peak_all=2 * 2**20, peak_own=2**20, loss_gap=1e-7)
    row |= dict(peak_ratio=0.9, peak_own_ratio=0.8, first_call_s=30.0, graphs=1, recompiles=0)
    rows = {
        "FSDP2": row | dict(ratio=1.0, first_call_s=0.1),
        "FSDP2 + torch.compile(model)": {"error": "RuntimeError: no"},
        "funcshard, whole step compiled": row,
    }
    del rows["FSDP2"]["graphs"], rows["FSDP2"]["recompiles"]
    res = dict(workload=dict(description="tiny", parameters=10), param_dtype="fp32")
    res |= dict(backend="inductor", memory_steps=3, baseline="FSDP2", rows=rows)
    machine = harness.machine(torch.device("cpu"))
    results = {"compile-2ranks": dict(result=res, world=2, rounds=10, warmup=2, machine=machine)}
    results["compile-2ranks"]["load_average_after"] = machine["load_average"]
    table = report.compile_section(results)
    assert "| FSDP2 + torch.compile(model) | failed: `RuntimeError: no` |" in table
    assert "| funcshard, whole step compiled | 10 | **0.50** | 2.0 | **0.90** |" in table
    assert table.count("\n| ") == 2 + 3  # header, rule, a row per variant (failed ones too)
    (summary,) = [
        line for line in report.summary_section(results).splitlines() if "compiled" in line
    ]
    assert "0.50x FSDP2 eager (FSDP2 + torch.compile: failed)" in summary
    assert next(iter(compiled.LABELS)) == compiled.BASELINE == "FSDP2"


def compile_smoke():
    """The compile part's first call on a tiny model (aot_eager: no code generation): the
    compiled whole step trains as the eager one, one graph, no recompilation; a variant failing
    on one rank is reported on both, and nothing raises."""
    ctx = harness.Context(mesh(dist.get_world_size()), torch.device("cpu"), True, 2, 1)
    w, o = linears(2, 8), Options(compile_backend="aot_eager")
    batches = [w.batch(i, ctx.rank) for i in range(3)]
    trainer, row = compiled.first_call(ctx, w, VARIANTS["funcshard + compile"], o, batches[0])
    eager = VARIANTS["funcshard"](w, ctx.mesh, o)
    eager.step(batches[0])
    gap = abs(trainer.step(batches[1]).item() - eager.step(batches[1]).item())
    row["recompiles"] = trainer.counter.frame_count - row["graphs"]

    def broken(w, mesh, options):
        if dist.get_rank() == 1:
            raise RuntimeError("only rank 1 fails\nsecond line")
        return VARIANTS["funcshard"](w, mesh, options)

    none, failed = compiled.first_call(ctx, w, broken, o, batches[0])
    return row, gap, none, failed


def test_compile_part_first_call_on_two_ranks(world2):
    for row, gap, none, failed in world2.run(compile_smoke):
        assert row["graphs"] == 1 and row["recompiles"] == 0 and row["first_call_s"] > 0
        assert gap < 1e-5
        assert none is None and failed == {"error": "RuntimeError: only rank 1 fails"}


def test_scale_and_driver_in_process(tmp_path):
    from benchmarks import run

    run.main(["--quick", "--only", "scale", "--out", str(tmp_path), "--no-report"])
    result = json.loads((tmp_path / "scale.json").read_text())["result"]
    for row in result["memory"]:  # per-rank parameters: P / W (+ padding) + the window
        assert row["per_rank_gib"] == pytest.approx(row["formula_gib"], rel=0.05)
    assert [r["world"] for r in result["memory"]] == [8, 1024]


def test_explain_part_in_process(tmp_path):
    """Part ``explain_scale`` (benchmarks/explain_scale.py) through the driver: the tiny Llama
    at 8 and 1024 fake ranks, with and without recompute; each largest batch fits the budget and
    the next batch, when tried, does not; recompute lowers the peak; the report's table has
    every row."""
    from benchmarks import explain_scale, run

    run.main(["--quick", "--only", "explain_scale", "--out", str(tmp_path), "--no-report"])
    data = json.loads((tmp_path / "explain_scale.json").read_text())
    result = data["result"]
    budget = 32e6 / 2**30
    peaks = {}
    for row in result["rows"]:
        by_batch = {int(b): p for b, p in row["peak_gib_by_batch"].items()}
        best = row["largest_batch"]
        assert best > 1 and by_batch[best] <= budget < by_batch[best + 1]
        peaks[row["world"], row["recompute"]] = row["peak_gib"]
    assert sorted(peaks) == [(8, False), (8, True), (1024, False), (1024, True)]
    assert peaks[8, True] < peaks[8, False] and peaks[1024, True] < peaks[1024, False]
    section = explain_scale.section({"explain_scale": data})
    assert section.count("| tiny") == 4 and "largest batch in 32MB" in section


def test_host_part_runs_quick():
    """benchmarks/host.py: one gloo rank, three frameworks at two depths (a subprocess: it makes
    its own process group)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.host", "--quick"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"},
    )  # fmt: skip
    rows = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert rows == ["plain", "FSDP2", "funcshard"]


def test_optim_host_part_steps_both_optimizers_alike(tmp_path):
    """benchmarks/optim_host.py: fs.optim and torch.optim on the same shards end with the same
    parameters (the same fused kernel, as many steps each), for both kernels, and with
    fs.optim's counts beside the parameters, and with clipping by the global norm."""
    for kernel in ([], ["--foreach"], ["--device-counts"], ["--clip"]):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.optim_host", "--leaves", "3,5", "--rounds", "1",
             "--out", str(tmp_path), *kernel],
            capture_output=True, text=True, timeout=300, check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"},
        )  # fmt: skip
        rows = [line.split() for line in out.stdout.splitlines()[2:]]
        assert [(r[0], r[-1]) for r in rows] == [("3", "True"), ("5", "True")], out.stdout


def test_host_counts_the_operations_a_step_dispatches():
    """benchmarks/host.py's call count: the ATen operations of one step, nested ones included
    (a hand count: an add of two tensors, and a cast that copies: to -> _to_copy ->
    empty_strided + copy_), in all and by name (``--ops``)."""
    from benchmarks.host import aten_calls, aten_ops

    x = torch.ones(3)
    assert aten_calls(lambda t: t + t, x) == 1
    assert aten_calls(lambda t: t.to(torch.float64), x) == 4
    cast = ["aten::to", "aten::_to_copy", "aten::empty_strided", "aten::copy_"]
    assert aten_ops(lambda t: t.to(torch.float64), x) == dict.fromkeys(cast, 1)


def test_launches_on_cpu_count_what_a_gpu_would_launch():
    """The CPU stand-in for kernel launches, against a hand count: an add and a sum launch,
    their views do not; a cast launches its copy, not its allocation; a composite counts its
    parts; a foreach operation counts once."""
    from benchmarks.harness import launches_on_cpu
    from benchmarks.host import aten_events

    x = torch.ones(4, 2)
    assert launches_on_cpu(aten_events(lambda t: (t + t).view(-1)[:3].sum(), x)) == 2
    assert launches_on_cpu(aten_events(lambda t: t.detach().t().to(torch.float64), x)) == 1
    assert launches_on_cpu(aten_events(lambda t: torch.nn.functional.linear(t, t), x)) == 1
    assert launches_on_cpu(aten_events(lambda t: torch._foreach_mul([t, t, t], 2.0), x)) == 1


def _parallel2d(out):
    from benchmarks import parallel2d

    tiny = ["--width", "16", "--depth", "1", "--heads", "2", "--vocab", "32", "--context", "8",
            "--rounds", "1", "--out", str(out)]  # fmt: skip
    return parallel2d.main(tiny)


def test_parallel2d_part_on_four_ranks(tmp_path):
    # ranks of their own: the part's (dp, tp) mesh would share cached sub-mesh groups with the
    # tests' meshes in the shared pool, and their per-dim collective counts would mix
    with fs.testing.Pool(4, timeout=240) as pool:
        result = pool.run(_parallel2d, tmp_path)[0]
    assert (tmp_path / "parallel2d-4ranks.json").is_file()
    ours, theirs = result["funcshard"], result["fsdp2"]
    assert ours["collectives"] == theirs["collectives"]  # the same collectives per mesh dim
    assert ours["sent_mib"] == theirs["sent_mib"]
    assert 0.5 < ours["sent_mib"]["dp"] / ours["dp_bound_mib"] <= 1.0


def test_fsdp2_checkpoint_wrapper_on_every_group_module():
    """The recompute part's FSDP2 baseline: each block inside a non-reentrant
    checkpoint_wrapper, and those wrappers are what fully_shard gets."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
    )

    from benchmarks.variants import _group_modules

    w = transformer(quick=True)
    model = w.build()
    wrapped = _group_modules(model, w.group_types, recompute=True)
    assert len(wrapped) == 2 and all(isinstance(m, CheckpointWrapper) for m in wrapped)
    assert all(m.checkpoint_impl == CheckpointImpl.NO_REENTRANT for m in wrapped)
    assert all(isinstance(m._checkpoint_wrapped_module, w.group_types) for m in wrapped)
    plain = _group_modules(w.build(), w.group_types, recompute=False)
    assert len(plain) == 2 and all(isinstance(m, w.group_types) for m in plain)


def recompute_smoke():
    ctx = harness.Context(mesh(dist.get_world_size()), torch.device("cpu"), True, 2, 1)
    return json.loads(json.dumps(recompute.run(ctx), default=str))


def test_recompute_part_on_two_ranks(world2):
    """Part ``recompute`` in quick mode: the four variants train the same model (FSDP2 and
    funcshard, with and without activation checkpointing), and the report renders it."""
    for r in world2.run(recompute_smoke):
        (table,) = r["tables"]
        assert list(table["rows"]) == [
            "FSDP2 + checkpoint_wrapper",
            "funcshard, recompute",
            "FSDP2",
            "funcshard",
        ]
        for row in table["rows"].values():
            assert row["loss_gap"] < 1e-5 and row["rounds"] == 2
            assert row["peak_all"] >= row["peak_own"] > 0
        assert table["rows"]["FSDP2 + checkpoint_wrapper"]["peak_ratio"] == 1.0
    machine = harness.machine(torch.device("cpu"))
    results = {"recompute-2ranks": dict(result=r, world=2, rounds=2, warmup=1, machine=machine)}
    results["recompute-2ranks"]["load_average_after"] = machine["load_average"]
    text = recompute.section(results)
    assert text.count("\n| ") == 2 + 4
    assert "| funcshard, recompute |" in text
    (line,) = recompute.summary_rows(results)
    assert line[0] == "recompute, transformer 2 sequences per rank"


def test_gpu_part_runs_quick_on_cpu(tmp_path):
    """benchmarks/gpu.py (the training step on one GPU) on a tiny model, one gloo rank: every
    variant either ran -- a finite step time, its memory at least the fp32 parameters and AdamW's
    two moments, the loss after the timed steps within bf16 rounding of plain torch's (the same
    weights, the same batches) -- or says why it was skipped; the report has a row for each."""
    subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick", "--device", "cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"},
    )  # fmt: skip
    r = json.loads((tmp_path / "gpu-cpu-tiny.json").read_text())
    assert r["machine"]["device"] == "cpu" and r["rounds"] == 3
    cfg = r["result"]
    model = gpu.workload("tiny", gpu.QUICK["tiny"], torch.device("cpu")).build()
    assert cfg["parameters"] == sum(p.numel() for p in model.parameters())
    rows = cfg["rows"]
    assert list(rows) == list(gpu.variants(torch.device("cpu"), "aot_eager"))
    skipped = {label for label, row in rows.items() if "skipped" in row}
    graphs = {"plain torch, CUDA graph", "funcshard, CUDA graph", "funcshard, compiled, CUDA graph",
              "funcshard, fs.jit, CUDA graph"}  # fmt: skip
    assert skipped == graphs
    for label, row in rows.items():
        if label in skipped:
            assert row["skipped"], label
            continue
        assert "error" not in row, (label, row.get("details"))
        assert math.isfinite(row["ms"]) and row["ms"] > 0 and row["host_ms"] > 0, label
        assert row["rounds"] == 3 and row["busy"] is None and row["mfu"] is None  # no GPU
        assert row["peak_bytes"] >= 3 * 4 * cfg["parameters"], label
        assert row["loss_gap"] < 1e-2, (label, row["loss"], rows["plain torch"]["loss"])
    assert rows["FSDP2"]["loss_gap_eager"] is None  # an eager step has no eager twin
    assert rows["FSDP2 + compile per block"]["loss_gap_eager"] < 1e-3
    assert rows["funcshard, fs.jit"]["loss_gap_eager"] < 1e-3  # against funcshard eager
    # the targets: every step-time one (CUDA graphs: not measured here), the first step's, a
    # graph's memory (not measured here), AdamW alone (the fused kernel; capturable: CUDA only)
    firsts = [[f"{a}, first step", f"{b}, first step", at] for a, b, at in gpu.FIRST_CALL_TARGETS]
    memory = [[f"{a}, peak memory", f"{b}, peak memory", at] for a, b, at in gpu.MEMORY_TARGETS]
    expected = [*map(list, gpu.TARGETS), *firsts, *memory, *map(list, gpu.OPTIMIZER_TARGETS)]
    assert [t[:3] for t in cfg["targets"]] == expected
    targets = {t[0]: t[3] for t in cfg["targets"]}
    first = (
        rows["funcshard, compiled"]["first_call_s"]
        / rows["FSDP2 + compile per block"]["first_call_s"]
    )
    assert targets["funcshard, compiled, first step"] == pytest.approx(first)
    assert targets["funcshard, CUDA graph, peak memory"] is None
    adamw = cfg["optimizer"]
    fused = adamw["fs.optim.adamw(fused=True)"] / adamw["torch.optim.AdamW(fused=True)"]
    assert targets["fs.optim.adamw(fused=True)"] == pytest.approx(fused)
    assert targets["fs.optim.adamw(capturable=True)"] is None
    table = gpu.section({"gpu-cpu-tiny": r})
    assert all(f"| {label} |" in table for label in rows)
    assert "| plain torch, CUDA graph | skipped: CUDA graphs need a CUDA device" in table


def test_gpu_part_at_fake_ranks_counts_calls(tmp_path):
    """``--fake-world 8`` on CPU: one rank of 8 over the fake process group, each variant with
    its aten calls and (CPU) leaf calls per step, the targets of several ranks, and AdamW alone
    on the shards against torch.optim's."""
    subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick", "--device", "cpu", "--fake-world",
         "8", "--variants", "FSDP2,funcshard", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    r = json.loads((tmp_path / "gpu-cpu-tiny-fake8.json").read_text())
    cfg = r["result"]
    assert cfg["world"] == 8 and cfg["fake"]
    for label in ("FSDP2", "funcshard"):
        row = cfg["rows"][label]
        assert 0 < row["launches"] < row["aten_calls"], (label, row)
    memory = [[f"{a}, peak memory", f"{b}, peak memory", at] for a, b, at in gpu.MEMORY_TARGETS]
    counts = [[f"funcshard, {k}", f"FSDP2, {k}", 1.0] for k in ("aten_calls", "launches")]
    expected = [*map(list, gpu.TARGETS_RANKS), *memory, *counts, *map(list, gpu.OPTIMIZER_TARGETS)]
    assert [t[:3] for t in cfg["targets"]] == expected
    targets = {t[0]: t[3] for t in cfg["targets"]}
    for key in ("aten_calls", "launches"):  # funcshard's count per step over FSDP2's
        ratio = cfg["rows"]["funcshard"][key] / cfg["rows"]["FSDP2"][key]
        assert targets[f"funcshard, {key}"] == pytest.approx(ratio)
    assert {"fs.optim.adamw(fused=True)", "torch.optim.AdamW(fused=True)"} <= set(cfg["optimizer"])
    table = gpu.section({"gpu-cpu-tiny-fake8": r})
    assert "**tiny, 8 fake ranks**" in table and "AdamW alone on the shards" in table


def test_graph_call_overhead_runs():
    from benchmarks import graph_call

    assert graph_call.main(calls=20) > 0


def test_gpu_part_keeps_a_failure_in_full():
    """A variant's error reaches the results whole: the table gets its first lines (with the
    line after a trailing "raised:"), the JSON the chained traceback."""
    try:
        try:
            raise ValueError("the real cause")
        except ValueError as cause:
            raise RuntimeError("backend='x' raised:\nCUDA error: not permitted") from cause
    except RuntimeError as e:
        row = gpu._failure(e, "build and first steps")
    assert row["error"] == "RuntimeError: backend='x' raised: CUDA error: not permitted"
    assert "ValueError: the real cause" in row["details"] and "Traceback" in row["details"]
    cells = gpu._cells(row)
    assert cells[0] == f"failed (build and first steps): `{row['error']}`"
    assert len(cells) == len(gpu.HEADER) - 1


def test_lowp_part_gathers_what_fsdp2_gathers(world2):
    """``benchmarks/lowp.py`` on a small float8 model: the same bytes each way as FSDP2, and the
    same trained parameters."""
    pytest.importorskip("torchao")
    from benchmarks import lowp

    for r in world2.run(lowp.measure, "float8", width=128, blocks=1, tokens=16, steps=1):
        assert r["max |funcshard - FSDP2| of the trained parameters"] == 0
        assert r["funcshard all-gathered KiB"] == r["FSDP2 all-gathered KiB"] > 0
        assert r["funcshard reduce-scattered KiB"] == r["FSDP2 reduce-scattered KiB"] > 0
