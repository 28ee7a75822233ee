"""``fs.cuda_graph`` and the optimizer's counts on the device, as far as a CPU can test them:
the capture mode, the static inputs and donation, the cache of graphs and its keys, the
refusals, and the device-count arithmetic against the host-count one. A CPU stand-in backend
runs the step where a GPU would record and replay it; ``tests/test_cuda.py`` runs the real
graphs against the eager step on a GPU."""

from __future__ import annotations

import pytest
import torch
from _graphs import same, train

import funcshard as fs
from funcshard._execution._cuda_graph import CudaGraphed, _refuse_host_tensors, _Rerun
from funcshard._runtime import _mode
from funcshard._runtime._mode import Mode


def test_capture_is_a_mode_with_its_own_rules():
    """Inside a capture the step runs as eager (pending collectives, frees) but is CAPTURED."""
    assert Mode.now() is Mode.EAGER
    with _mode.capture():
        mode = Mode.now()
        assert _mode.capturing()
    assert mode is Mode.CAPTURED and Mode.now() is Mode.EAGER
    assert mode.eager and mode.asynchronous and mode.frees and mode.plain and mode.captured
    assert not mode.traced and not Mode.EAGER.captured


def test_without_cuda_the_graph_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    graphed = fs.cuda_graph(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="CUDA is not available here"):
        graphed(torch.ones(2))


@pytest.mark.parametrize("micro", [1, 2])
def test_graphed_step_equals_eager_on_the_stand_in(world2, micro):
    """Two ranks, clipping, a schedule, micro-batches: the graphed step (stand-in backend) gives
    the eager step's losses, parameters and state bit for bit; one graph is captured."""
    results = world2.run(_graphed_vs_eager, micro)
    for diff, graphs in results:
        assert diff == {"losses": 0.0, "params": 0.0, "state": 0.0}
        assert graphs == 1


def _graphed_vs_eager(micro):
    # fused: on CPU, the kernel that reads the learning rate tensor itself (the loop over
    # tensors reads it on the host, which the stand-in's capture refuses as a GPU's would)
    eager = train("cpu", False, 8, micro=micro, fused=True)
    graphed = train("cpu", True, 8, micro=micro, fused=True, backend=_Rerun())
    return same(eager, graphed), graphed["graphs"]


@pytest.mark.parametrize("how", ["torch.compile", "fs.jit"])
def test_a_compiled_step_is_captured_on_the_stand_in(world2, how):
    """``fs.cuda_graph(torch.compile(step))`` and ``fs.cuda_graph(fs.jit(step))``: the compiled
    step runs compiled under the capture's checks (Dynamo does not skip it for their dispatch
    mode; the jitted step's graph was traced in the first warm-up call), and the graphed run
    gives the compiled step's losses, parameters and state bit for bit; compiled (traced) once
    -- the capture compiles nothing more --, one graph."""
    for diff, graphs, frames in world2.run(_graphed_compiled_vs_compiled, how):
        assert diff == {"losses": 0.0, "params": 0.0, "state": 0.0}
        assert (graphs, frames) == (1, 1)


def _graphed_compiled_vs_compiled(how: str):
    # aot_eager, and the traced graph as it is: quick (inductor's code is captured on a GPU:
    # tests/test_cuda.py)
    kw = {"compile_backend": "aot_eager"} if how == "torch.compile" else {"jit_backend": "eager"}
    compiled = train("cpu", False, 6, fused=True, **kw)
    graphed = train("cpu", True, 6, fused=True, backend=_Rerun(), **kw)
    return same(compiled, graphed), graphed["graphs"], graphed["frames"]


def _counting(calls: list):
    def step(w, x, scale):
        calls.append(1)
        w.add_(x * scale)  # donated: w is returned as received
        return (w * x).sum(), w

    return step


def test_static_inputs_donation_and_copies():
    """The batch is copied into the graph's slot at every call; the weight, returned as it was
    received, is donated (updated in place, returned itself); the loss comes back as a copy."""
    calls = []
    graphed = CudaGraphed(_counting(calls), warmup=1, max_graphs=2, backend=_Rerun())
    w = torch.zeros(3)
    ref = torch.zeros(3)
    for i in range(5):
        x = torch.full((3,), float(i + 1))
        loss, w_out = graphed(w, x, 2.0)
        ref.add_(x * 2.0)
        assert w_out is w
        assert torch.equal(w, ref) and loss.item() == (ref * x).sum().item()
    entry = next(iter(graphed.entries.values()))
    assert loss is not entry.out[0]  # a copy of the graph's output
    assert entry.donated == {0}
    assert entry.slots[0] is w and entry.slots[1] is not x  # the batch has its own slot
    assert graphed.graphs == 1


def test_a_new_shape_or_value_is_captured_anew_up_to_the_bound():
    graphed = CudaGraphed(_counting([]), warmup=1, max_graphs=2, backend=_Rerun())
    w3, w4 = torch.zeros(3), torch.zeros(4)
    for _ in range(3):
        graphed(w3, torch.ones(3), 1.0)
        graphed(w4, torch.ones(4), 1.0)
    assert graphed.graphs == 2 and torch.equal(w3, torch.full((3,), 3.0))
    with pytest.raises(ValueError, match=r"'\[0\]\[2\]' is 3\.0, was 1\.0.*max_graphs=2"):
        graphed(w4, torch.ones(4), 3.0)  # a Python number is part of the key
    with pytest.raises(ValueError, match=r"'\[0\]\[0\]' is a Tensor \[5\].*max_graphs=2"):
        graphed(torch.zeros(5), torch.ones(5), 1.0)


def _reads_on_the_host(w, x):
    loss = (w * x).sum()
    if loss > 0:  # data-dependent control flow
        w.add_(x)
    return loss, w


def _item(w, x):
    w.add_(x)
    return float((w * x).sum().item()), w


@pytest.mark.parametrize(("step", "line"), [(_reads_on_the_host, "if loss > 0"),
                                             (_item, "return float")])  # fmt: skip
def test_host_reads_are_refused_naming_the_line(step, line):
    graphed = CudaGraphed(step, warmup=1, max_graphs=1, backend=_Rerun())
    w = torch.zeros(2)
    graphed(w, torch.ones(2))  # the warm-up runs eagerly
    message = r"cannot be captured: aten::_local_scalar_dense reads a device value on the host"
    with pytest.raises(RuntimeError, match=rf"{message}.*test_cuda_graph\.py:\d+ \({line}"):
        graphed(w, torch.ones(2))


def test_an_optimizer_with_host_counts_is_refused_in_the_capture():
    """adamw without capturable keeps its counts on the host: the capture says what to do."""
    opt = fs.optim.adamw(1e-2)

    def step(p, s, g):
        return fs.optim.step(opt, p, g, s)

    graphed = CudaGraphed(step, warmup=1, max_graphs=1, backend=_Rerun())
    p = {"w": torch.ones(3)}
    s = opt.init(p)
    p, s = graphed(p, s, {"w": torch.ones(3)})
    with pytest.raises(RuntimeError, match=r"step counts live on the host.*capturable=True"):
        graphed(p, s, {"w": torch.ones(3)})


@pytest.mark.parametrize("fused", [False, True])
def test_device_counts_equal_host_counts(fused):
    """capturable=True keeps the counts as tensors updated by the step and calls the schedule
    with the count tensor: on CPU it gives the host-count path's numbers bit for bit (a linear
    schedule: the same float64 arithmetic), over clipping, weight-decay groups, a frozen leaf."""
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 4), "b": torch.randn(4), "frozen": torch.randn(3)}
    lr = fs.optim.linear_schedule(1e-3, 1e-2, 7)
    mask = fs.optim.at_least_2d
    results = []
    for capturable in (False, True):
        opt = fs.optim.chain(
            fs.optim.clip_by_global_norm(1.0),
            fs.optim.adamw(lr, weight_decay=0.1, mask=mask, fused=fused, capturable=capturable),
        )
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        for i in range(12):
            g = torch.Generator().manual_seed(i)
            grads = {k: torch.randn(v.shape, generator=g) for k, v in p.items()}
            grads["frozen"] = None
            p, state = fs.optim.step(opt, p, grads, state)
        results.append((p, state))
    (p0, s0), (p1, s1) = results
    for k in params:
        assert torch.equal(p0[k], p1[k]), k
    assert int(s0[1].count) == int(s1[1].count) == 12
    assert float(s1[1].steps["w"]) == 12.0 and float(s1[1].steps["frozen"]) == 0.0


def test_device_counts_pure_update_equals_donated():
    opt = fs.optim.adamw(fs.optim.cosine_decay_schedule(1e-2, 20), capturable=True)
    p = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(1))}
    q = {"w": p["w"].clone()}
    sp, sq = opt.init(p), opt.init(q)
    for i in range(5):
        g = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(i))}
        updates, sp = opt.update(g, sp, p)
        p = fs.optim.apply_updates(p, updates)
        q, sq = fs.optim.step(opt, q, {"w": g["w"].clone()}, sq)
    torch.testing.assert_close(p["w"], q["w"], atol=1e-7, rtol=0)
    assert int(sp.count) == int(sq.count) == 5


def test_a_cpu_tensor_argument_is_refused_by_name():
    """Checked at a layout's first call, before the warm-up trains: on a GPU every tensor
    argument must be there (here: the host counts of an optimizer without capturable)."""
    state = fs.optim.adamw(1e-2).init({"w": torch.ones(2)})
    with pytest.raises(TypeError, match=r"argument '\[1\]\.count' is a tensor on cpu.*capturable"):
        _refuse_host_tensors(["[0]", "[1].count"], [None, state.count])
