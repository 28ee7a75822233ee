"""``fs.jit``: a step traced once per signature (make_fx over the local shards), compiled, and run
as its graph: equal to the eager step over many steps, the plan's order, prefetch and reshard in
the graph, one trace per signature up to a bound, errors that name the line, static and donated
arguments, identical blocks traced and compiled once, a peak memory no higher than the eager
step's. See docs/compile.md and funcshard/_execution/_jit.py.

Most tests run the traced graph as it is (``backend="eager"``: no code generation, quick on the
2-core CI machine); those marked ``inductor`` compile with inductor (``make test-compile`` runs
them, ``make test`` leaves them out).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_compile import Block, Net, _batch, _copy, _events, _flat_numel
from torch import nn

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

from _mesh import mesh

TOL = dict(atol=1e-5, rtol=1e-5)


def _scheduled(hidden=(5, 5, 6), **plan_kw):
    torch.manual_seed(0)
    model = Net(hidden)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(Block), **plan_kw)
    apply = fs.schedule(model, plan)
    model.to("meta")
    return model, plan, apply, sharded, buffers


def _train_step(apply, buffers, opt):
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x, buffers=buffers), y))

    def step(params, state, x, y):
        loss, grads = vg(params, x, y)
        params, state = fs.optim.step(opt, params, grads, state)
        return loss, params, state

    return step


def many_steps(backend: str, steps: int, regions: bool = True):
    """``steps`` steps of the jitted scheduled step (AdamW, a warm-up cosine schedule) beside
    the eager one: the losses at every step, the parameters and state at the end; one trace;
    the parameters are the arguments, updated in place."""
    _, _, apply, sharded, buffers = _scheduled()
    lr = fs.optim.warmup_cosine_decay_schedule(0.0, 0.02, warmup_steps=3, decay_steps=steps)
    opt = fs.optim.adamw(lr, weight_decay=0.1)
    step = _train_step(apply, buffers, opt)
    jitted = fs.jit(step, backend=backend, regions=regions)
    eager_p, jit_p = _copy(sharded), _copy(sharded)
    eager_s, jit_s = opt.init(eager_p), opt.init(jit_p)
    gaps, same = [], True
    for i in range(steps):
        x, y = _batch(i)
        eager_loss, eager_p, eager_s = step(eager_p, eager_s, x, y)
        before = jit_p
        jit_loss, jit_p, jit_s = jitted(jit_p, jit_s, x, y)
        same = same and all(jit_p[k] is before[k] for k in before)
        gaps.append(abs(jit_loss.item() - eager_loss.item()) / abs(eager_loss.item()))
    fs.testing.assert_close((jit_p, jit_s), (eager_p, eager_s), atol=1e-4, rtol=1e-4)
    moves = [(jit_p[k].to_local() - sharded[k].to_local()).abs() for k in sharded]
    moved = max(m.max().item() for m in moves if m.numel())  # a shard may be empty
    return max(gaps), jitted.traces, same, int(jit_s.count), moved


@pytest.mark.parametrize(
    ("backend", "regions"),
    [
        ("eager", True),
        pytest.param("inductor", True, marks=pytest.mark.inductor),
        pytest.param("inductor", False, marks=pytest.mark.inductor),
    ],
)
def test_many_steps_equal_eager(world2, backend, regions):
    """20 steps: the traced graph as it is, compiled in pieces (the default), compiled whole."""
    steps = 20
    for gap, traces, same, count, moved in world2.run(many_steps, backend, steps, regions):
        assert gap <= 1e-5, gap  # every step's loss, relative
        assert (traces, same, count) == (1, True, steps)
        assert moved > 1e-2  # trained: not a comparison of untouched parameters


def graph_follows_plan(plan_kw: dict):
    """The traced graph's all-gathers and waits are the plan's all_gather/wait steps, in order
    (its prefetch included); every group's gradient is reduce-scattered once; and whether the
    forward's gathered parameters are read in backward (not when resharded after forward)."""
    _, plan, apply, sharded, buffers = _scheduled(hidden=(5, 6), **plan_kw)
    opt = fs.optim.sgd(0.1)
    jitted = fs.jit(_train_step(apply, buffers, opt), backend="eager")
    jitted(sharded, opt.init(sharded), *_batch(0))
    (graph,) = jitted.graphs()
    events, last_use, nodes = _events(graph, _flat_numel(plan, sharded))
    planned = [
        (s.op, s.group) for s in plan.forward + plan.backward if s.op in ("all_gather", "wait")
    ]
    scatters = sum("reduce_scatter" in str(n.target) for n in nodes)
    # autograd seeds the backward with ones_like(loss): everything after it is backward
    backward_starts = next(i for i, n in enumerate(nodes) if "ones_like" in str(n.target))
    kept_out = {g: last_use[g] < backward_starts for g in last_use if g}
    return events, planned, scatters, len(plan.groups), kept_out


PLANS = {
    "default": {},
    "no prefetch": {"prefetch": 0, "backward_prefetch": 0},
    "prefetch 2": {"prefetch": 2, "backward_prefetch": 2},
    "kept after forward": {"reshard_after_forward": False},
}


def test_graph_follows_plan(world2):
    orders = {}
    for name, kw in PLANS.items():
        for events, planned, scatters, groups, kept_out in world2.run(graph_follows_plan, kw):
            assert events == planned, (name, events, planned)
            assert scatters == groups
            resharded = kw.get("reshard_after_forward", True)
            assert planned.count(("all_gather", "blocks.0")) == (2 if resharded else 1)
            assert kept_out and all(kept_out.values()) == resharded, (name, kept_out)
            assert any(kept_out.values()) == resharded, (name, kept_out)
            orders[name] = planned
    # the control: prefetching two groups ahead changes the order, and the graph followed it
    assert orders["prefetch 2"] != orders["default"]


def mixed_precision_hsdp_frozen():
    """bf16 gathers, fp32 reductions, a (replicate, shard) mesh and a frozen parameter, jitted:
    value_and_grad's value and gradients (None for the frozen one) equal the eager call's."""
    torch.manual_seed(0)
    model = Net((3,))
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(2, 1))
    sharded["inp.bias"].requires_grad_(False)
    model.to("meta")
    plan = fs.plan(model, fs.policy.by_type(Block))
    apply = fs.schedule(model, plan, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x, buffers=buffers).float(), y))
    jitted = fs.jit(vg, backend="eager")
    x, y = _batch(0, dtype=torch.bfloat16)
    got, want = jitted(sharded, x, y), vg(sharded, x, y)
    fs.testing.assert_close(got, want, **TOL)
    return got[1]["inp.bias"] is None


def test_mixed_precision_hsdp_and_frozen(world2):
    assert world2.run(mixed_precision_hsdp_frozen) == [True, True]


# ---- one trace per signature, side effects once, static and donated arguments --------------


def test_python_runs_once_per_signature_up_to_the_bound():
    """The step's Python (a print, a counter) runs at the trace only; a new shape traces again;
    after max_traces a new signature is refused, naming the leaf that changed."""
    calls = []

    def step(w, x):
        calls.append(x.shape[0])
        w.add_(x.sum(0))
        return (w * 2).sum(), w

    jitted = fs.jit(step, max_traces=2, backend="eager")
    w, ref = torch.zeros(3), torch.zeros(3)
    for n in (4, 4, 5, 4, 5):
        x = torch.ones(n, 3)
        loss, out = jitted(w, x)
        ref.add_(x.sum(0))
        assert out is w and torch.equal(w, ref) and loss.item() == (ref * 2).sum().item()
    assert calls == [4, 5] and jitted.traces == 2
    with pytest.raises(ValueError, match=r"'\[0\]\[1\]' is a Tensor \[6, 3\].*max_traces=2"):
        jitted(w, torch.ones(6, 3))
    with pytest.raises(ValueError, match=r"'\[0\]\[1\]' is .*torch.float64.*max_traces=2"):
        jitted(w, torch.ones(5, 3, dtype=torch.float64))


def test_static_arguments_are_part_of_the_signature():
    def scaled(x, power, *, offset):
        return x**power + offset

    jitted = fs.jit(scaled, static_argnames=("power", "offset"), backend="eager")
    x = torch.arange(3.0)
    for power, offset in ((2, 0.5), (3, 0.5), (2, 0.5), (2, 1.0)):
        assert torch.equal(jitted(x, power, offset=offset), x**power + offset)
    assert jitted.traces == 3
    with pytest.raises(TypeError, match=r"static argument 'power'.*list.*not hashable"):
        jitted(x, [2], offset=0.0)
    with pytest.raises(ValueError, match=r"\['nope'\] name no argument of scaled"):
        fs.jit(scaled, static_argnames="nope")


def test_a_pure_step_with_donated_parameters_updates_them_in_place():
    """opt.update + apply_updates (a new tree) under donate_argnames: the new parameters are
    written into the arguments' tensors and returned as them; without donation the arguments
    are left as they were. Both equal the eager step."""
    opt = fs.optim.sgd(0.1, momentum=0.9)

    def step(params, state, x):
        grads = torch.func.grad(lambda p: (p["w"] @ x).square().sum())(params)
        updates, state = opt.update(grads, state, params)
        return fs.optim.apply_updates(params, updates), state

    start = {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0))}
    for donate in ((), ("params",)):
        jitted = fs.jit(step, donate_argnames=donate, backend="eager")
        p, s = {"w": start["w"].clone()}, opt.init(start)
        eager_p, eager_s = {"w": start["w"].clone()}, opt.init(start)
        for i in range(3):
            x = torch.randn(4, generator=torch.Generator().manual_seed(i))
            old = p["w"]
            old_value = old.clone()
            p, s = jitted(p, s, x)
            eager_p, eager_s = step(eager_p, eager_s, x)
            fs.testing.assert_close((p, s), (eager_p, eager_s), atol=1e-6, rtol=1e-6)
            assert (p["w"] is old) == bool(donate)
            assert torch.equal(old, old_value) != bool(donate)


def _item(w, x):
    return w * float((w * x).sum().item())


def _branch(w, x):
    loss = (w * x).sum()
    if loss > 0:  # data-dependent control flow
        return w + x
    return w - x


def _nonzero(w, x):
    return w[x > 0.5].sum()


@pytest.mark.parametrize(
    ("step", "what", "line"),
    [
        (_item, "reads a device value on the host", "return w \\* float"),
        (_branch, "reads a device value on the host", "if loss > 0"),
        (_nonzero, "makes a shape from a tensor's values", "return w\\[x > 0.5\\]"),
    ],
)
def test_host_reads_and_value_shapes_are_refused_naming_the_line(step, what, line):
    jitted = fs.jit(step, backend="eager")
    with pytest.raises(RuntimeError, match=rf"jit: {step.__name__} cannot be traced: .*{what}"
                                           rf".*test_jit\.py:\d+ \({line}"):  # fmt: skip
        jitted(torch.ones(3), torch.ones(3))


def _host_copy(w, x):
    return w + (w * x).sum().cpu().to(w.device)


def _host_tensor(w, x):
    return w * torch.arange(3.0)


@pytest.mark.parametrize(
    ("step", "line"),
    [
        (_host_copy, r"return w \+ \(w \* x\).sum\(\).cpu"),
        (_host_tensor, r"return w \* torch.arange"),
    ],
)
def test_host_copies_are_refused_naming_the_line(step, line):
    """A copy to the host, or a CPU tensor mixed with the device's, in a step on a device (meta
    tensors stand in for a GPU's): refused while tracing, naming the line."""
    jitted = fs.jit(step, backend="eager")
    meta = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match=rf"jit: {step.__name__} cannot be traced: .*uses a CPU "
                                           rf"tensor .* a copy between host and device"
                                           rf".*test_jit\.py:\d+ \({line}"):  # fmt: skip
        jitted(meta, meta)


def test_tensor_subclass_arguments_are_refused():
    """A low-precision weight (a tensor subclass of the tests' own, as torchao's are) among
    the arguments: refused before tracing, naming the argument and the way that takes it."""
    from _lowp import Int8Rows

    w = Int8Rows(torch.randn(4, 3))
    jitted = fs.jit(lambda p, x: (p["w"] @ x).sum(), backend="eager")
    refused = r"argument '\[0\]\[0\].w' is a Int8Rows .*torch.compile\(step, fullgraph=True\)"
    with pytest.raises(NotImplementedError, match=refused):
        jitted({"w": w}, torch.ones(3))
    assert jitted.traces == 0


def test_bad_arguments_of_jit():
    with pytest.raises(TypeError, match="step is a int"):
        fs.jit(3)
    with pytest.raises(ValueError, match="max_traces=0"):
        fs.jit(lambda x: x, max_traces=0)
    with pytest.raises(ValueError, match="backend='tvm'"):
        fs.jit(lambda x: x, backend="tvm")
    with pytest.raises(ValueError, match=r"\['x'\] cannot be both static and donated"):
        fs.jit(lambda x: x, static_argnames="x", donate_argnames="x")


# ---- identical blocks traced once --------------------------------------------------------------


class Counted(nn.Module):
    """A block that counts the runs of its Python forward."""

    runs = 0

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        Counted.runs += 1
        return x + torch.tanh(self.fc(x))


def _counted(blocks: int):
    """A scheduled model of ``blocks`` identical blocks: ``(apply, sharded, buffers)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), *(Counted(8) for _ in range(blocks)), nn.Linear(8, 1))
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    return fs.schedule(model, fs.plan(model, fs.policy.by_type(Counted))), sharded, buffers


def block_runs(blocks: int):
    """The runs of a block's forward while a scheduled step of ``blocks`` identical blocks is
    traced, and whether its values equal the eager step's."""
    apply, sharded, buffers = _counted(blocks)
    vg = fs.value_and_grad(lambda p, x: apply(p, x, buffers=buffers).square().mean())
    jitted = fs.jit(vg, backend="eager")
    x = _batch(0)[0]
    Counted.runs = 0
    got = jitted(sharded, x)
    runs = Counted.runs
    fs.testing.assert_close(got, vg(sharded, x), **TOL)
    calls = [n for n in jitted.graphs()[0].graph.nodes
             if n.target is torch.ops.higher_order.invoke_subgraph]  # fmt: skip
    return runs, len(calls), len({n.args[0].target for n in calls})


def test_identical_blocks_are_traced_once(world2):
    """Four identical blocks run their Python as often as one does (the first block's joint
    graph, shared by all), and call one forward and one backward subgraph."""
    for (one, calls_one, _), (four, calls, bodies) in zip(
        world2.run(block_runs, 1), world2.run(block_runs, 4), strict=True
    ):
        assert four == one, (one, four)
        assert (calls_one, calls, bodies) == (2, 8, 2)


def compiled_pieces(blocks: int):
    """What a step of ``blocks`` identical blocks compiles in pieces (a backend that records
    each graph it is given and runs it as it is): the regions' bodies and the segments, by
    their operators; and whether the step's values equal the eager step's."""
    apply, sharded, buffers = _counted(blocks)
    vg = fs.value_and_grad(
        lambda p, x: F.mse_loss(apply(p, x, buffers=buffers).tanh().exp(), x[:, :1].sigmoid())
    )
    pieces = []

    def record(graph, examples):
        pieces.append(sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"}))
        return graph

    jitted = fs.jit(vg, backend=record)
    x = _batch(0)[0]
    fs.testing.assert_close(jitted(sharded, x), vg(sharded, x), **TOL)
    fs.testing.assert_close(jitted(sharded, 2 * x), vg(sharded, 2 * x), **TOL)
    return pieces


def test_a_step_is_compiled_in_pieces_the_same_at_any_depth(world2):
    """Two identical blocks or five: the same pieces are compiled -- one forward and one
    backward body (matmuls, tanh), and the loss's segment (exp, sigmoid, mse) --, and nothing
    of the scheduler's part (collectives, funcshard's operators)."""
    for two, five in zip(world2.run(compiled_pieces, 2), world2.run(compiled_pieces, 5),
                         strict=True):  # fmt: skip
        assert two == five
        assert len(two) == 3, two
        ops = {op for piece in two for op in piece}
        assert {"aten.tanh.default", "aten.exp.default", "aten.sigmoid.default"} <= ops
        assert not any("c10d" in op or op.startswith("funcshard.") for op in ops), ops


# ---- memory ------------------------------------------------------------------------------------


def peaks(regions: bool):
    """The peak of one training step's own CPU allocations (the allocator's events: live bytes,
    not time), eager and jitted (inductor), on blocks whose activations (a batch of 512, 256
    wide) dwarf their parameters; and one block's activation, for scale."""
    _, _, apply, sharded, buffers = _scheduled(hidden=(256, 256, 256, 256))
    opt = fs.optim.adamw(1e-3)
    step = _train_step(apply, buffers, opt)
    jitted = fs.jit(step, regions=regions)
    eager_p, jit_p = _copy(sharded), _copy(sharded)
    eager_s, jit_s = opt.init(eager_p), opt.init(jit_p)
    x, y = _batch(0, n=512)
    step(eager_p, eager_s, x, y)
    jitted(jit_p, jit_s, x, y)  # traced and compiled
    out = {}
    for name, run in (("eager", step), ("jit", jitted)):
        p, s = (eager_p, eager_s) if name == "eager" else (jit_p, jit_s)
        gc.collect()
        out[name], _ = peak_bytes(lambda r=run, p=p, s=s: r(p, s, x, y), this_thread=True)
    return out, 512 * 256 * 4


@pytest.mark.inductor
@pytest.mark.parametrize("regions", [True, False], ids=["in pieces", "whole"])
def test_peak_memory_is_at_most_the_eager_steps(world2, regions):
    for got, activation in world2.run(peaks, regions):
        assert got["eager"] > 4 * activation, got  # the count sees the activations
        assert got["jit"] <= got["eager"], got


# ---- the private torch APIs of the trace and the compilation ---------------------------------


def test_private_torch_apis_of_jit(tmp_path, monkeypatch):
    """What funcshard/_runtime/_compat.py's ``trace_graph`` and ``compile_graph`` rely on
    (make_fx in a TracingContext, compile_fx with fake inputs and a ShapeEnv): ``compiling()``
    is true while tracing, the graph mutates its input as the function does, and the compiled
    graph computes the same; compiling it again finds it in inductor's FX graph cache and in
    AOTAutograd's cache. Fails on a torch upgrade that changes them."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from funcshard._runtime._compat import compile_graph, compiling, trace_graph

    seen = []

    def fn(w, x):
        seen.append(compiling())
        w.mul_(0.5).add_(x)
        return [torch.tanh(w).sum()]

    w, x = torch.randn(4), torch.randn(4)
    graph = trace_graph(fn, [w, x])
    assert seen == [True] and not compiling()
    expected = torch.tanh(w * 0.5 + x).sum()
    w_graph, w_compiled = w.clone(), w.clone()
    torch.testing.assert_close(graph(w_graph, x)[0], expected)
    torch.testing.assert_close(w_graph, w * 0.5 + x)
    with fresh_cache():
        counters.clear()
        compiled = compile_graph(graph, [w, x])
        torch.testing.assert_close(compiled(w_compiled, x)[0], expected)
        torch.testing.assert_close(w_compiled, w * 0.5 + x)
        compile_graph(graph, [w, x])
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 1
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
