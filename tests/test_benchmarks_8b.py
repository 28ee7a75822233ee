"""The GPU session's script and its 8B part, on the CPU: Llama-3.1-8B's shapes on meta,
torchtitan's FLOP count by hand, both frameworks starting from the same shards, results written
as each variant and each part finishes, and ``benchmarks/gpu_check.sh`` end to end at tiny
shapes. No timing is asserted: performance numbers live in BENCHMARKS.md."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_8b, gpu_8b_report
from benchmarks.fake import fake_world
from benchmarks.host import Llama
from benchmarks.variants import VARIANTS

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def test_the_8b_configuration_is_llama_3_1_8b_on_meta():
    """gpu_8b's model has Llama-3.1-8B's shapes -- 8,030,261,248 parameters, as Meta publishes
    -- and is built on the meta device (no memory), its rotary tables in bf16."""
    m = gpu_8b.model(gpu_8b.LLAMA_8B)
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    assert all(t.is_meta for t in [*m.parameters(), *m.buffers()])
    assert shapes["embed.weight"] == shapes["head.weight"] == (128256, 4096)
    assert shapes["blocks.0.wq.weight"] == shapes["blocks.0.wo.weight"] == (4096, 4096)
    assert shapes["blocks.0.wk.weight"] == shapes["blocks.0.wv.weight"] == (1024, 4096)  # 8 KV
    assert shapes["blocks.0.w1.weight"] == shapes["blocks.0.w3.weight"] == (14336, 4096)
    assert shapes["blocks.31.w2.weight"] == (4096, 14336) and "blocks.32.w2.weight" not in shapes
    total = sum(math.prod(s) for s in shapes.values())
    assert gpu_8b.parameters(gpu_8b.LLAMA_8B) == total == 8_030_261_248
    assert m.cos.shape == (8192, 64) and m.cos.dtype == torch.bfloat16


def test_mfu_counts_attention_as_torchtitan():
    """torchtitan's model FLOPs per token, by hand: 6 per parameter outside the embedding table
    (8,030,261,248 - 128,256 x 4,096) plus 12 x 32 layers x 32 heads x 128 x 8,192 positions
    for attention; MFU = that x tokens/s over the peak."""
    s = gpu_8b.LLAMA_8B
    matmuls, attention = 6 * (8_030_261_248 - 525_336_576), 12 * 32 * 32 * 128 * 8192
    assert (matmuls, attention) == (45_029_548_032, 12_884_901_888)
    assert gpu_8b.flop_per_token(s) == matmuls + attention
    assert gpu_8b.mfu(7300, s, 989.0) == pytest.approx((matmuls + attention) * 7300 / 989e12)
    assert gpu_8b.mfu(6667, s, 989.0) == pytest.approx(0.3904, abs=1e-4)  # torchtitan's compile


def _rank0_chunks(s: gpu_8b.Shape) -> list[torch.Tensor]:
    """The model built normally (seed 0, every tensor real), each parameter's rank-0 chunk of 8."""
    torch.manual_seed(0)
    m = Llama(s.layers, s.width, s.heads, s.vocab, s.seq, hidden=s.hidden, kv_heads=s.kv_heads)
    return [torch.chunk(p.detach(), s.world)[0] for p in m.parameters()]


@pytest.mark.parametrize("key", ["fsdp2", "fsdp2 + compile per block", "funcshard"])
def test_every_variant_starts_from_the_models_shards(key):
    """Built on meta and initialised into shards (fs.materialize once, copied per variant;
    FSDP2 sharded on meta, then given storage and the copies), every variant's local shards
    are the rank-0 chunks of the same model built normally, and recompute wrappers (FSDP2's
    ``checkpoint_wrapper``, torchtitan's selection by operator) change nothing of that."""
    s = gpu_8b.TINY
    form = "ops" if key.startswith("fsdp2") else gpu_8b.BLOCKS
    with fake_world(s.world) as mesh:
        w = gpu_8b.workload(s, CPU, gpu_8b.Initial())
        trainer = VARIANTS[key](w, mesh, gpu_8b.options(form, s, "eager"))
        local = trainer.parameters()
    reference = _rank0_chunks(s)
    assert len(local) == len(reference)
    for a, b in zip(local, reference, strict=True):
        assert torch.equal(a, b)


def test_gpu_8b_saves_each_variant_and_set_as_it_goes():
    """One set at tiny shapes on the CPU (8 fake ranks in this process): the rows are handed to
    ``save`` after each variant's first steps (a run cut short keeps them) and when the set is
    timed; each timed row's tokens/s is the batch over its step time, its peak at least the
    rank's fp32 shards and AdamW's two moments, and the report has a row for each."""
    s = gpu_8b.TINY
    args = argparse.Namespace(variants=None, backend="aot_eager", warmup=0, rounds=1,
                              peak_tflops=None)  # fmt: skip
    saved: list[dict] = []
    with fake_world(s.world) as mesh:
        w = gpu_8b.workload(s, CPU, gpu_8b.Initial())
        rows = gpu_8b.measure_set("selective AC", s, w, mesh, CPU, args, lambda r: saved.append(
            copy.deepcopy(r)))  # fmt: skip
    labels = list(gpu_8b.SETS["selective AC"])
    assert [list(r) for r in saved] == [labels[:1], labels, labels]
    assert "first_call_s" in saved[0][labels[0]] and "ms" not in saved[1][labels[1]]
    shards = 3 * 4 * gpu_8b.parameters(s) / s.world
    for label in labels:
        row = rows[label]
        assert "error" not in row, row.get("details")
        assert row["tokens_per_s"] == pytest.approx(s.batch * s.seq / (row["ms"] / 1e3))
        assert row["peak_bytes"] >= shards, label
    assert rows["funcshard"]["x_baseline"] > 0 and rows["funcshard"]["recompute"] == "blocks"
    result = {"description": s.describe(), "parameters": 1, "flop_per_token": 1, "keep": 1,
              "peak_tflops": None, "sets": {"selective AC": rows}, "set_seconds": {}}  # fmt: skip
    machine = {"cores": 2, "cpu": "cpu", "load_average": [0.0], "date": "2026", "torch": "x"}
    text = gpu_8b_report.section({"gpu8b-cpu": {"result": result, "rounds": 1,
                                  "machine": machine, "load_average_after": [0.0]}})  # fmt: skip
    assert all(f"| {label} |" in text for label in labels)


def test_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    """``benchmarks/gpu_check.sh OUT --device cpu --quick``: every part runs (exit 0) and leaves
    its JSON -- the 8B sets, explain's prediction and check, the 36M/271M parts at one rank and
    8 fake ranks, the main job's modes -- and the main job's ``--recompute`` repeats eager's
    losses exactly (fp32 on the CPU: the same forward, run again)."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"}
    subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path), "--device", "cpu",
                    "--quick"], cwd=ROOT, env=env, timeout=1500, check=True,
                   capture_output=True, text=True)  # fmt: skip
    summary = (tmp_path / "summary.log").read_text()
    for part in ("1. gpu_8b", "0. gpu_8b_explain --predict", "2. gpu_8b_explain --check",
                 "3. gpu, one rank", "3. gpu, 8 fake ranks", "4. main_job"):  # fmt: skip
        assert f"{part} rc=0" in summary, summary
    read = lambda name: json.loads((tmp_path / f"{name}.json").read_text())["result"]
    assert list(read("gpu8b-cpu")["sets"]) == list(gpu_8b.SETS)
    assert set(read("gpu8b-predict-cpu")["forms"]) == {gpu_8b.FULL, gpu_8b.BLOCKS}
    check = read("gpu8b-check-cpu")
    assert check["measured_peak_bytes"] > 0 and {"h100", "measured"} <= set(check)
    assert read("gpu-cpu-tiny")["rows"] and read("gpu-cpu-tiny-fake8")["world"] == 8
    jobs = read("main_job-cpu")
    assert list(jobs) == ["eager", "recompute", "compile", "eager again"]  # no graphs on CPU
    assert jobs["recompute"]["losses"] == jobs["eager"]["losses"]
    assert jobs["compile"]["loss_rel_diff"] < 1e-3
