"""``fs.explain``: its prediction of one rank's step against the real step."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs

# ---- accuracy against the real step, on 2 gloo ranks ---------------------------------------
# The reference is independent of the ledger: the allocator's own events for the peak
# (``peak_bytes(this_thread=True)`` plus what is resident before the step) and torch.profiler's
# record of the c10d operators for the collectives (``benchmarks/explain_accuracy.py``, whose
# table in BENCHMARKS.md covers more models).

TOLERANCE = 0.05

CONFIGURATIONS = {
    "reshard": {},
    "no reshard": {"reshard_after_forward": False},
    "recompute": {"recompute": True},
}


def explained_and_measured(options: dict) -> dict:
    """On each rank: explain's peak and collectives, and the real step's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard as fs
    from benchmarks import explain_accuracy as ea
    from funcshard._runtime._profiling import peak_bytes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    s = ea.setup(ea.mlp_case(blocks=3, width=128, rows=128, **options), mesh)
    hardware = fs.Hardware({torch.float32: 1e10}, 1e10, 1e-6, 1e9, 1e-5)  # time is not tested
    e = fs.explain(
        s.apply, s.params, *s.batch, optimizer=s.opt, buffers=s.buffers, loss=s.loss,
        hardware=hardware,
    )  # fmt: skip
    for _ in range(2):  # warm-up: the first creates nothing more (the state is made), but
        s.step()  # allocator behaviour settles
    # A gather still in flight when the peak comes adds gloo's flat output buffer, depending
    # on timing (see [Note: gloo's buffers] in funcshard/_pricing/_explain.py): the least of 3
    # steps.
    measured = min(peak_bytes(s.step, this_thread=True)[0] for _ in range(3))
    return {
        "predicted": e.peak_bytes,
        "measured": measured + ea.resident_bytes(s),
        "collectives": ea.predicted_collectives(e),
        "profiled": ea.profiled_collectives(s),
    }


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_explain_peak_and_collectives_match_the_real_step(world2, name):
    for rank, r in enumerate(world2.run(explained_and_measured, CONFIGURATIONS[name])):
        error = (r["predicted"] - r["measured"]) / r["measured"]
        assert abs(error) <= TOLERANCE, (rank, name, r["predicted"], r["measured"], error)
        assert r["profiled"], (rank, name)  # the profiler saw the step's collectives
        assert r["collectives"] == r["profiled"], (rank, name)


def test_private_torch_api_of_explain():
    """``_explain._counters_known`` makes a fake 0-dim tensor that knows its value with
    ``FakeTensorMode.fake_tensor_converter.from_real_tensor(..., make_constant=True)``."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    made = mode.fake_tensor_converter.from_real_tensor(
        mode, torch.tensor(7, dtype=torch.int64), make_constant=True
    )
    assert isinstance(made, FakeTensor) and made.ndim == 0
    with mode:
        assert int(made) == 7
        assert int(made + 1) == 8  # an operator on it keeps a known value


def test_explain_counters_known_are_the_first_step():
    from funcshard._pricing import _explain

    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    state = {"count": torch.tensor(3.0), "moment": torch.ones(2)}
    known = _explain._counters_known(state, mode)
    with mode:
        assert float(known["count"]) == 0.0  # the first step's count
    assert known["moment"] is state["moment"]  # tensors with dimensions stay as they are


def test_explain_accuracy_section_has_a_row_per_configuration():
    from benchmarks import explain_accuracy as ea

    row = {
        "configuration": "mlp, fp32",
        "measured_peak": [100 * 2**20, 101 * 2**20],
        "predicted_peak": [95 * 2**20, 100 * 2**20],
        "worst_peak_error": -0.05,
        "collectives_equal": False,
        "collectives": [["all_gather", 4, 8, 3], ["reduce_scatter", 8, 4, 2]],
        "measured_step_s": 0.1,
        "predicted_step_s": 0.15,
        "step_error": 0.5,
    }
    machine = {"cpu": "cpu", "cores": 2, "load_average": [1.0], "torch": "2", "date": "2026-11-28"}
    result = {"world": 2, "machine": machine, "load_average_after": [1.0]}
    text = ea.section({"explain-2ranks": result | {"result": {"rows": [row]}}})
    assert "| mlp, fp32 | 101.00 | 100.00 | **-5.0%** | **no** | 5 | 100 | 150 | +50% |" in text
    assert "peak error at most 5.0%" in text and "2 ranks" in text


def test_private_torch_apis_explain_runs_on():
    """What fs.explain's fake step relies on, outside the converter: a dispatch mode pushed over
    ``FakeTensorMode`` sees every operator with fake arguments (and a DTensor one first, to
    which it may answer ``NotImplemented``); ``torch._C._len_torch_dispatch_stack`` counts the
    modes (``Deferred`` makes its placeholders outside them); fake storages have weak
    references that die with them, and sizes that ``resize_`` changes. Fails on a torch
    upgrade that changes any of it."""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Seeing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func._overloadpacket.__name__, type(args[0]).__name__))
            return func(*args, **(kwargs or {}))

    assert torch._C._len_torch_dispatch_stack() == 0
    with FakeTensorMode(), Seeing():
        assert torch._C._len_torch_dispatch_stack() == 2
        x = torch.empty(4, 4)
        y = x @ x
        storage = y.untyped_storage()
        dead = []
        weakref.finalize(storage, lambda: dead.append(True))
        storage.resize_(0)
        assert storage.nbytes() == 0
        del y, storage
        assert dead == [True]
    assert isinstance(x, FakeTensor) and ("mm", "FakeTensor") in seen


# ---- grouped matmuls (a mixture's experts) in float32 ---------------------------------------
GROUPS, K, N = 4, 8, 12  # rows of 16-byte multiples, as the CPU kernel wants
OFFSETS = (3, 3, 7, 10)  # cumulative rows per group (group 1 gets none)


def _grouped_layouts():
    """``(mat_a, mat_b)`` of the three ways a mixture of experts calls ``aten._grouped_mm``:
    tokens times stacked weights (forward), times their transpose (the input's gradient), and
    tokens' transpose times the output's gradient (the weights' gradient)."""
    g = torch.Generator().manual_seed(0)
    rows = OFFSETS[-1]
    x, w = torch.randn(rows, K, generator=g), torch.randn(GROUPS, K, N, generator=g)
    dy = torch.randn(rows, N, generator=g)
    return [(x, w), (dy, w.transpose(-2, -1)), (x.t(), dy)]


def test_private_torch_api_of_grouped_mm():
    """``torch._meta_registrations._create_grouped_mm_output_tensor`` makes what the real CPU
    kernel returns in float32 (size, strides, dtype), and torch's fake kernel of
    ``aten._grouped_mm`` still refuses float32 -- which is why ``_compat.fake_kernel`` uses
    the former (see [Note: grouped matmuls on fake tensors]). Fails on a torch upgrade that
    changes either: then the rule may go."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from funcshard._runtime._compat import _create_grouped_mm_output_tensor

    offs = torch.tensor(OFFSETS, dtype=torch.int32)
    for a, b in _grouped_layouts():
        real = torch._grouped_mm(a, b, offs=offs)
        made = _create_grouped_mm_output_tensor(a, b, offs, torch.float32)
        assert (made.shape, made.stride(), made.dtype) == (real.shape, real.stride(), real.dtype)
    a, b = _grouped_layouts()[0]
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(a, b, offs=offs)


class Experts(torch.nn.Module):
    """A mixture's experts, stacked, computed by one grouped matmul (as Hugging Face's
    Mixtral, Qwen3-MoE and DeepSeek-V3 do through ``torch.nn.functional.grouped_mm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(GROUPS, K, N))

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w, offs=offs)


def test_grouped_matmuls_in_float32_are_explained():
    """The fake step of a float32 grouped matmul runs (torch's fake kernel takes bf16 only),
    and its FLOPs are those ``torch.utils.flop_counter`` counts for the same step written as
    one matmul per expert (forward, and the weights' gradient)."""
    from torch.utils.flop_counter import FlopCounterMode

    from funcshard._pricing._fake_world import fake_world

    with fake_world(2) as mesh:
        model = Experts()
        params, _ = fs.extract(model)
        sharded = fs.shard(params, mesh)
        apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Experts)))
        model.to("meta")
        x, offs = torch.randn(OFFSETS[-1], K), torch.tensor(OFFSETS, dtype=torch.int32)
        hardware = fs.Hardware({torch.float32: 1e10}, 1e10, 1e-6, 1e9, 1e-5)
        e = fs.explain(apply, sharded, x, offs, hardware=hardware)
    w = params["w"].detach().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        starts = (0, *OFFSETS[:-1])
        out = torch.cat(
            [x[s:end] @ w[i] for i, (s, end) in enumerate(zip(starts, OFFSETS, strict=True))]
        )
        out.sum().backward()
    assert e.flops == counter.get_total_flops() == 2 * 2 * OFFSETS[-1] * K * N
