"""A compiled step in a second process finds what the first one compiled: inductor's FX graph
cache, shared through ``TORCHINDUCTOR_CACHE_DIR``, gives the second process the first one's
graph, and that graph computes what eager funcshard does. Under ``torch.compile`` that is
inductor's cache alone; under ``fs.jit`` AOTAutograd's cache too (the trace is funcshard's, and
the graph is the key: [Note: a traced graph in the caches] in ``funcshard/_runtime/_compat.py``).
See docs/compile.md ("Where the compile time goes") and [Note: a mesh in a cache key] there.

Each process is a one-rank gloo world of its own, started with another ``PYTHONHASHSEED``: the
salt of ``hash()`` differs between processes, as it does between any two runs of a job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def child(how: str = "torch.compile") -> None:
    """One process: compile the whole step (inductor; ``how``: ``torch.compile`` or
    ``fs.jit``), run it twice beside the eager step; print the cache counters and the compiled
    losses."""
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard as fs

    store = tempfile.mktemp(prefix="funcshard-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, init_device_mesh("cpu", (1,)))
    model.to("meta")
    vg = fs.value_and_grad(
        lambda p, x, y: F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)
    )
    opt = fs.optim.adamw(1e-2)

    def step(p, s, x, y):
        loss, grads = vg(p, x, y)
        p, s = fs.optim.step(opt, p, grads, s)
        return loss, p, s

    compiled = torch.compile(step, fullgraph=True) if how == "torch.compile" else fs.jit(step)
    eager = {k: v.detach().clone() for k, v in sharded.items()}
    state, eager_state = opt.init(sharded), opt.init(eager)
    losses, eager_losses = [], []
    for i in range(2):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(i))
        y = x.sum(1, keepdim=True)
        loss, sharded, state = compiled(sharded, state, x, y)
        eager_loss, eager, eager_state = step(eager, eager_state, x, y)
        losses.append(loss.item())
        eager_losses.append(eager_loss.item())
    fs.testing.assert_close((sharded, state), (eager, eager_state), atol=1e-5, rtol=1e-5)
    caches = {**counters["inductor"], **counters["aot_autograd"]}
    print(json.dumps({"losses": losses, "eager": eager_losses, **caches}))
    dist.destroy_process_group()


def _run(cache: Path, seed: int, how: str = "torch.compile") -> dict:
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        PYTHONHASHSEED=str(seed),
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    out = subprocess.run(
        [sys.executable, "-c", f"import test_compile_cache as t; t.child({how!r})"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1800)
def test_a_second_process_finds_the_compiled_graph(tmp_path):
    first = _run(tmp_path, seed=1)
    second = _run(tmp_path, seed=2)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert second.get("fxgraph_cache_hit", 0) >= 1, second
    assert second.get("fxgraph_cache_miss", 0) == 0, second
    for run in (first, second):
        assert run["losses"] == pytest.approx(run["eager"], abs=1e-5, rel=1e-5)
    assert second["losses"] == pytest.approx(first["losses"], abs=1e-6)


@pytest.mark.inductor
@pytest.mark.timeout(1800)
def test_a_second_process_finds_the_jitted_step_in_both_caches(tmp_path):
    first = _run(tmp_path, seed=1, how="fs.jit")
    second = _run(tmp_path, seed=2, how="fs.jit")
    # each compiled piece of the step (docs/compile.md) is a graph of its own in the caches
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert first["autograd_cache_saved"] == first["autograd_cache_miss"] >= 1, first
    assert second.get("autograd_cache_hit", 0) == first["autograd_cache_miss"], second
    assert second.get("autograd_cache_miss", 0) == 0, second
    assert second.get("fxgraph_cache_hit", 0) >= 1, second
    for run in (first, second):
        assert run["losses"] == pytest.approx(run["eager"], abs=1e-5, rel=1e-5)
    assert second["losses"] == first["losses"]
