"""fs.testing: rank pools (results, errors, hangs, restarts, isolation, overhead), assert_close,
reference_value_and_grad (against hand-computed gradients) and check_plan."""

from __future__ import annotations

import collections
import gc
import os
import pickle
import subprocess
import sys
import threading
import time
from unittest.mock import ANY

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import funcshard as fs

from _checks import raises
from _models import Block, TinyLM, tokens

Pair = collections.namedtuple("Pair", "rank tensor")


# ---- running functions on ranks ----------------------------------------------------------------
def test_results_by_value_in_rank_order():
    full = torch.arange(20.0).view(5, 4)

    def on_rank(full, *, scale):
        mesh = init_device_mesh("cpu", (2,))
        sharded = fs.shard({"w": full * scale}, mesh)
        big = torch.arange(1000.0, requires_grad=True) * 1
        return {
            "dtensor": sharded["w"],
            "local": fs.to_local(sharded)["w"],
            "pair": Pair(dist.get_rank(), big[:3]),  # a view of a larger, grad-requiring tensor
            "rest": [None, "text", 1.5],
        }

    results = fs.testing.run(on_rank, full, scale=2.0)
    expected = torch.chunk(full * 2.0, 2)  # torch.chunk is how DTensor splits uneven dims
    for rank, r in enumerate(results):
        assert type(r["dtensor"]) is torch.Tensor and type(r["local"]) is torch.Tensor
        torch.testing.assert_close(r["dtensor"], expected[rank])
        torch.testing.assert_close(r["local"], expected[rank])
        assert type(r["pair"]) is Pair and r["pair"].rank == rank
        t = r["pair"].tensor
        assert not t.requires_grad and t.untyped_storage().nbytes() == 3 * 4  # the view only
        assert r["rest"] == [None, "text", 1.5]


def test_ranks_have_a_process_group_and_torchrun_environment():
    def environment():
        return (
            dist.get_backend(),
            dist.get_world_size(),
            {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")},
            torch.get_num_threads(),
        )

    results = fs.testing.run(environment)
    for rank, (backend, world, env, threads) in enumerate(results):
        assert (backend, world, threads) == ("gloo", 2, 1)
        assert env == dict(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"
        )
    # the test process itself is untouched
    assert "RANK" not in os.environ and not dist.is_initialized()


def test_rank_output_is_echoed(capsys):
    fs.testing.run(lambda: print(f"hello from {dist.get_rank()}", file=sys.stderr))
    err = capsys.readouterr().err
    assert "[rank 0] hello from 0" in err and "[rank 1] hello from 1" in err


_COLD = """
import time
from unittest.mock import ANY
t0 = time.perf_counter()
import torch.distributed as dist
import funcshard as fs
t1 = time.perf_counter()

if __name__ == "__main__":
    assert fs.testing.run(dist.get_rank) == [0, 1]
    t2 = time.perf_counter()
    assert fs.testing.run(dist.get_rank) == [0, 1]
    t3 = time.perf_counter()
    print(f"import funcshard {t1 - t0:.2f} s, first run {t2 - t1:.2f} s, next {t3 - t2:.4f} s")
"""


def test_overhead_cold_and_warm(tmp_path):
    """Printed, not asserted (pytest -s shows it): a fresh script's first call, and pools."""
    script = tmp_path / "cold.py"
    script.write_text(_COLD)  # also: run works from a plain script, under __main__
    cold = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True
    )
    print(f"\ncold, new process: {cold.stdout.strip()}")
    times = []
    with fs.testing.Pool(2) as pool:
        for _ in range(4):
            start = time.perf_counter()
            assert pool.run(dist.get_rank) == [0, 1]
            times.append(time.perf_counter() - start)
    print(
        f"new pool, forkserver running: first call {times[0]:.3f} s, "
        f"next calls {', '.join(f'{t * 1000:.1f}' for t in times[1:])} ms"
    )


# ---- failures ----------------------------------------------------------------------------------
def _rank_1_raises():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 disagrees")
    dist.barrier()  # rank 0 waits for rank 1


def test_exception_names_rank_and_traceback_then_ranks_restart():
    before = fs.testing.run(os.getpid)
    with pytest.raises(
        fs.testing.RankError, match="failed on rank 1: rank 1 raised ValueError"
    ) as info:
        fs.testing.run(_rank_1_raises)
    message = str(info.value)
    assert "ValueError: rank 1 disagrees" in message
    assert "in _rank_1_raises" in message  # the traceback, with this file's lines
    assert 'raise ValueError("rank 1 disagrees")' in message
    assert isinstance(info.value.__cause__, ValueError)
    assert list(info.value.errors) == [1] and info.value.unfinished == (0,)
    assert "rank 0, stack when stopped" in message and "in barrier" in message
    copy = pickle.loads(pickle.dumps(info.value))  # e.g. for pytest-xdist
    assert (str(copy), copy.errors, copy.unfinished) == (message, {1: ANY}, (0,))
    after = fs.testing.run(os.getpid)
    assert not set(before) & set(after)  # killed and restarted


def test_every_rank_raising_is_reported_once():
    def all_raise():
        raise KeyError("same everywhere")

    with pytest.raises(fs.testing.RankError, match="failed on ranks 0, 1") as info:
        fs.testing.run(all_raise)
    assert str(info.value).count("KeyError: 'same everywhere'") == 2  # summary + one traceback
    assert sorted(info.value.errors) == [0, 1] and info.value.unfinished == ()


def _rank_0_all_reduces():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


@pytest.mark.timeout(120)  # the point: a mismatched collective never hangs the test
def test_hang_is_a_timeout_naming_the_ranks():
    start = time.perf_counter()
    with pytest.raises(fs.testing.RankError, match="Rank 0 did not finish") as info:
        fs.testing.run(_rank_0_all_reduces, timeout=2)
    print(f"\nhang detected after {time.perf_counter() - start:.2f} s (timeout=2)")
    assert info.value.unfinished == (0,) and info.value.errors == {}
    assert "within 2 s" in str(info.value)
    assert "in _rank_0_all_reduces" in str(info.value) and "in all_reduce" in str(info.value)
    assert fs.testing.run(dist.get_rank) == [0, 1]


def test_a_rank_that_dies():
    def die():
        if dist.get_rank() == 1:
            os._exit(3)
        return "alive"

    with pytest.raises(fs.testing.RankError, match="exited with code 3"):
        fs.testing.run(die)
    assert fs.testing.run(dist.get_rank) == [0, 1]


def test_unpicklable_function_or_result():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"cannot send .*lock"):
        fs.testing.run(lambda: lock.locked())
    with pytest.raises(fs.testing.RankError, match="cannot be sent back"):
        fs.testing.run(threading.Lock)


def test_ranks_cannot_start_ranks():
    with pytest.raises(fs.testing.RankError, match="cannot be started inside a rank"):
        fs.testing.run(fs.testing.run, dist.get_rank)


def test_bad_arguments_and_start_up_failures():
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        fs.testing.Pool(0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        fs.testing.Pool(2, timeout=0)
    with (
        fs.testing.Pool(2, backend="no-such-backend") as pool,
        pytest.raises(fs.testing.RankError, match="starting the ranks failed on ranks 0, 1"),
    ):
        pool.run(dist.get_rank)


def test_two_pools_alive_at_once_do_not_collide():
    def total(offset):
        x = torch.tensor([dist.get_rank() + offset])
        dist.all_reduce(x)
        return x.item(), os.getpid()

    with fs.testing.Pool(2) as a, fs.testing.Pool(3) as b:
        for _ in range(2):  # interleaved calls
            ra, rb = a.run(total, 10.0), b.run(total, 100.0)
            assert [v for v, _ in ra] == [21.0] * 2 and [v for v, _ in rb] == [303.0] * 3
            assert not {p for _, p in ra} & {p for _, p in rb}
        with pytest.raises(fs.testing.RankError):  # a failure in one pool ...
            a.run(_rank_1_raises)
        assert [v for v, _ in b.run(total, 0.0)] == [3.0] * 3  # ... leaves the other alone
        assert [v for v, _ in a.run(total, 0.0)] == [1.0] * 2


def _gone(pid: int) -> bool:
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_dropped_pool_stops_its_ranks():
    pool = fs.testing.Pool(2)
    pids = pool.run(os.getpid)
    del pool
    gc.collect()
    assert all(_gone(pid) for pid in pids)
    with fs.testing.Pool(2) as pool:
        pids = pool.run(os.getpid)
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        pool.run(os.getpid, timeout=0)


# ---- assert_close ------------------------------------------------------------------------------
def _assert_close_on_rank():
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(5, 3, generator=g), "b": [torch.randn(4, generator=g), None]}
    sharded = {"a": fs.shard({"a": full["a"]}, mesh)["a"], "b": [full["b"][0], None]}
    fs.testing.assert_close(sharded, full)  # DTensor vs full, plain vs plain, None vs None
    fs.testing.assert_close(fs.to_local(sharded), full)  # LocalShard leaves
    fs.testing.assert_close(full, sharded)  # sharded expected values are gathered too
    # one rank's shard off: the gathered tensor differs on every rank
    off = sharded["a"].to_local() + (1.0 if dist.get_rank() == 1 else 0.0)
    a = sharded["a"]
    wrong = {
        "a": DTensor.from_local(off, mesh, a.placements, shape=a.shape, stride=a.stride()),
        "b": full["b"],
    }
    return [
        raises(lambda: fs.testing.assert_close(wrong, full), AssertionError, "1 of 2", "a: "),
        raises(
            lambda: fs.testing.assert_close({"a": sharded["a"]}, full),
            AssertionError,
            "missing from actual: 'b[0]'",
        ),
        raises(
            lambda: fs.testing.assert_close(sharded["a"], full["a"].double()),
            AssertionError,
            "dtype",
        ),
    ]


def test_assert_close_gathers_and_names_key_paths():
    assert fs.testing.run(_assert_close_on_rank) == [[None, None, None]] * 2


def test_assert_close_outside_ranks():
    a, b = {"x": torch.ones(3), "y": 2.0}, {"x": torch.ones(3), "y": 2.0}
    fs.testing.assert_close(a, b)
    with pytest.raises(AssertionError, match=r"x: Tensor-likes are not close"):
        fs.testing.assert_close({**a, "x": torch.zeros(3)}, b)
    fs.testing.assert_close({**a, "x": a["x"] + 1e-3}, b, atol=1e-2, rtol=0)


# ---- reference_value_and_grad ------------------------------------------------------------------
def _regression(w, x, y):
    return ((x @ w["w"] + w["b"] - y) ** 2).mean()


def _by_hand(w, x, y):
    """The mean squared error and its gradient, written out."""
    r = x @ w["w"] + w["b"] - y
    n = r.numel()
    return (r**2).sum() / n, {"w": 2 * x.T @ r / n, "b": 2 * r.sum(0, keepdim=True) / n}


def _batch(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)


def _full_params():
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(1, 2, generator=g)}


def _reference_on_rank(sizes):
    rank = dist.get_rank()
    sharded = fs.shard(_full_params(), init_device_mesh("cpu", (2,)))
    x, y = _batch(rank, sizes[rank])
    value, grads = fs.testing.reference_value_and_grad(_regression, sharded, x, y)
    everyone = [_batch(r, sizes[r]) for r in range(2)]
    global_x, global_y = (torch.cat(t) for t in zip(*everyone, strict=True))
    _, hand_grads = _by_hand(_full_params(), global_x, global_y)
    torch.testing.assert_close(value, _by_hand(_full_params(), x, y)[0])  # this rank's value
    torch.testing.assert_close(grads, hand_grads)  # the global batch's gradient
    # funcshard's step: the mean over ranks of each rank's gradient
    loss, fs_grads = fs.value_and_grad(lambda p, x, y: _regression(fs.unshard(p), x, y))(
        sharded, x, y
    )
    try:
        fs.testing.assert_close((loss, fs_grads), (value, grads))
        return "equal"
    except AssertionError:
        return "differ"


@pytest.mark.parametrize(("sizes", "expected"), [((4, 4), "equal"), ((2, 6), "differ")])
def test_reference_is_the_global_batch(sizes, expected):
    """Equal per-rank batches: funcshard's mean of means is the global mean; unequal: not."""
    assert fs.testing.run(_reference_on_rank, sizes) == [expected] * 2


def _reference_errors_on_rank():
    sharded = fs.shard(_full_params(), init_device_mesh("cpu", (2,)))
    x, y = _batch(dist.get_rank(), 4)
    ref = fs.testing.reference_value_and_grad
    loss = lambda p, batch, scale: _regression(p, batch["x"], batch["y"]) * scale
    value, grads = ref(loss, sharded, {"x": x, "y": y}, 2.0)  # a tree batch, a plain number
    x_cols = x if dist.get_rank() == 0 else x[:, :2]
    return [
        raises(lambda: ref(_regression, sharded, torch.tensor(1.0), y), ValueError, "batch[0]"),
        raises(lambda: ref(_regression, sharded, x_cols, y), ValueError, "batch[0] has shapes"),
        raises(lambda: ref(_regression, sharded, sharded["w"], y), TypeError, "is sharded"),
        raises(lambda: ref(lambda p: p["w"], sharded), TypeError, "one-element tensor"),
        raises(lambda: ref(_regression, {"w": 1.0}, x, y), TypeError, "params['w'] is a float"),
        value.shape == () and sorted(grads) == ["b", "w"],
    ]


def test_reference_trees_and_errors():
    assert fs.testing.run(_reference_errors_on_rank) == [[None] * 5 + [True]] * 2


def test_reference_without_process_group():
    params, (x, y) = _full_params(), _batch(0, 5)
    value, grads = fs.testing.reference_value_and_grad(_regression, params, x, y)
    hand_value, hand_grads = _by_hand(params, x, y)
    torch.testing.assert_close(value, hand_value)
    torch.testing.assert_close(grads, hand_grads)
    assert all(not p.requires_grad for p in params.values())  # inputs untouched


# ---- check_plan --------------------------------------------------------------------------------
def test_check_plan_recorded_plan_is_ok_and_edits_are_reported():
    model = TinyLM(layers=3).to("meta")  # tied embedding/head: the root group runs first and last
    batch = tokens(0)
    plan = fs.plan(model, fs.policy.by_type(Block), example_args=(batch,))
    check = fs.testing.check_plan(model, plan, batch)
    assert check.ok and check.used == plan.order == ("", "blocks.0", "blocks.1", "blocks.2", "")
    assert str(check).startswith("check_plan: ok")

    swapped = plan.replace(order=("", "blocks.1", "blocks.0", "blocks.2", ""))
    check = fs.testing.check_plan(model, swapped, batch)
    assert not check.ok and check.never_used == ()
    assert set(check.out_of_order) <= {"blocks.0", "blocks.1"} and check.out_of_order
    assert check.first_difference() == 1
    assert "first difference at run 1: planned blocks.1, used blocks.0" in str(check)

    short = plan.replace(order=("", "blocks.0", "blocks.1", ""))  # blocks.2 not planned
    assert fs.testing.check_plan(model, short, batch).out_of_order == ("blocks.2",)


def test_check_plan_reports_groups_never_used():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    model = Skips()
    check = fs.testing.check_plan(
        model, fs.plan(model, fs.policy.by_type(nn.Linear)), torch.ones(2)
    )
    assert check.never_used == ("unused",) and check.out_of_order == () and not check.ok
    assert "never used: unused" in str(check) and "ignored=" in str(check)
    assert not dist.is_initialized()  # no process group was needed


def test_check_plan_errors():
    model = nn.Sequential(nn.Linear(2, 2))
    other = fs.plan(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), fs.policy.by_type(nn.Linear))
    with pytest.raises(ValueError, match=r"does not have: \['1.bias', '1.weight'\]"):
        fs.testing.check_plan(model, other, torch.ones(2))

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x) if x.sum().item() > 0 else x

    dd = DataDependent()
    with pytest.raises(RuntimeError, match="check_plan: the dry run of DataDependent"):
        fs.testing.check_plan(dd, fs.plan(dd), torch.ones(2))
