"""funcshard under torch.compile: the same values and gradients as eager, one compilation for a
training step (a learning-rate schedule included, computed in the graph), the shards as graph
inputs, and a scheduled step whose graph follows its plan (prefetch, and re-gathers in backward
for reshard-after-forward). See docs/compile.md.

Compiling is slow on the 2-core CI machine: the models are tiny, most tests use ``aot_eager``
(the graphs AOTAutograd records, run op by op) and one uses ``inductor``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import Shard

import funcshard as fs

from _mesh import mesh

TOL = dict(atol=1e-5, rtol=1e-5)


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """The root (``inp``, ``out``) runs first and last; blocks of different widths, so that each
    group's all-gather has its own size in a graph."""

    def __init__(self, hidden=(5, 6)) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block(8, h) for h in hidden)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _setup(*mesh_shape, hidden=(3,)):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(hidden)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(*(mesh_shape or (dist.get_world_size(),))))
    model.to("meta")
    return model, sharded, buffers


def _batch(step: int, n: int = 4, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(n, 4, generator=g).to(dtype), torch.randn(n, 1, generator=g)


def _copy(tree):
    return {k: v.detach().clone() for k, v in tree.items()}


def _recording(graphs: list):
    """An aot_eager backend that keeps the graphs AOTAutograd makes."""

    def keep(gm, _):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


# ---- a whole training step ---------------------------------------------------------------------


def _donated_step(model, buffers, opt):
    """A whole training step: value_and_grad over unshard, then the donated fs.optim.step."""
    vg = fs.value_and_grad(
        lambda p, x, y: F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)
    )

    def step(params, state, x, y):
        loss, grads = vg(params, x, y)
        params, state = fs.optim.step(opt, params, grads, state)
        return loss, params, state

    return step


def _train_side_by_side(step, compiled, opt, sharded, steps: int):
    """``steps`` steps of ``step`` eagerly and ``compiled`` on copies of ``sharded``, equal at
    every step; the final (eager, compiled) params and states."""
    eager_p, comp_p = _copy(sharded), _copy(sharded)
    eager_s, comp_s = opt.init(eager_p), opt.init(comp_p)
    for i in range(steps):
        x, y = _batch(i)
        eager_loss, eager_p, eager_s = step(eager_p, eager_s, x, y)
        comp_loss, comp_p, comp_s = compiled(comp_p, comp_s, x, y)
        fs.testing.assert_close((comp_loss, comp_p), (eager_loss, eager_p), **TOL)
    return (eager_p, eager_s), (comp_p, comp_s)


def whole_step():
    """value_and_grad over unshard + fs.optim.step (AdamW), fullgraph: equal to eager for new
    data every step, compiled once; the shards are inputs (an in-place change is seen)."""
    model, sharded, buffers = _setup()
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    step = _donated_step(model, buffers, opt)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    (eager_p, eager_s), (comp_p, comp_s) = _train_side_by_side(step, compiled, opt, sharded, 3)
    assert int(comp_s.count) == 3
    with torch.no_grad():  # the graph reads the shards it is given, not copies of old ones
        for p in (*eager_p.values(), *comp_p.values()):
            p.to_local().mul_(0.5)
    x, y = _batch(3)
    fs.testing.assert_close(compiled(comp_p, comp_s, x, y)[0], step(eager_p, eager_s, x, y)[0])
    return counter.frame_count


def pure_update_step():
    """The pure optimizer form (opt.update + apply_updates), SGD with momentum, and a frozen
    parameter (its gradient and update are None) under fullgraph."""
    model, sharded, buffers = _setup()
    sharded["inp.bias"].requires_grad_(False)
    opt = fs.optim.sgd(0.1, momentum=0.9)
    vg = fs.value_and_grad(
        lambda p, x, y: F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)
    )

    def step(params, state, x, y):
        loss, grads = vg(params, x, y)
        updates, state = opt.update(grads, state, params)
        return loss, grads["inp.bias"], fs.optim.apply_updates(params, updates), state

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager = comp = (sharded, opt.init(sharded))
    for i in range(2):
        x, y = _batch(i)
        e_loss, _, e_p, e_s = step(*eager, x, y)
        c_loss, c_frozen, c_p, c_s = compiled(*comp, x, y)
        assert c_frozen is None
        fs.testing.assert_close((c_loss, c_p, c_s.momentum), (e_loss, e_p, e_s.momentum), **TOL)
        eager, comp = (e_p, e_s), (c_p, c_s)
    return counter.frame_count


def test_whole_step(world2):
    assert world2.run(whole_step) == [1, 1]
    assert world2.run(pure_update_step) == [1, 1]


def many_scheduled_steps(steps: int):
    """A whole step over fs.schedule (reshard after forward, prefetch) with AdamW and a
    warm-up schedule, compiled once: ``steps`` steps under error_on_recompile, each loss within
    1e-4 of the eager step's, the parameters at the end too."""
    model, sharded, buffers = _setup(hidden=(5, 5, 6))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x, buffers=buffers), y))
    lr = fs.optim.warmup_cosine_decay_schedule(0.0, 0.02, warmup_steps=3, decay_steps=steps)
    opt = fs.optim.adamw(lr, weight_decay=0.1)

    def step(params, state, x, y):
        loss, grads = vg(params, x, y)
        params, state = fs.optim.step(opt, params, grads, state)
        return loss, params, state

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_p, comp_p = _copy(sharded), _copy(sharded)
    eager_s, comp_s = opt.init(eager_p), opt.init(comp_p)
    gaps = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(steps):
            x, y = _batch(i)
            eager_loss, eager_p, eager_s = step(eager_p, eager_s, x, y)
            comp_loss, comp_p, comp_s = compiled(comp_p, comp_s, x, y)
            gaps.append(abs(comp_loss.item() - eager_loss.item()))
    fs.testing.assert_close(comp_p, eager_p, atol=1e-4, rtol=1e-4)
    moves = [(comp_p[k].to_local() - sharded[k].to_local()).abs() for k in sharded]
    moved = max(m.max().item() for m in moves if m.numel())  # a shard may be empty
    return counter.frame_count, int(comp_s.count), max(gaps), moved


def test_many_scheduled_steps(world2):
    for frames, count, gap, moved in world2.run(many_scheduled_steps, 20):
        assert (frames, count) == (1, 20)
        assert gap < 1e-4
        assert moved > 1e-2  # trained: the comparison is not of untouched parameters


# ---- a learning-rate schedule in the graph ------------------------------------------------------


def scheduled_step(kind: str, steps: int = 6):
    """A whole step with warmup_cosine_decay_schedule, compiled once and never recompiled: the
    schedule is computed in the graph from the count it reads, equal to eager (the float path)
    at every step, across the end of the warm-up."""
    model, sharded, buffers = _setup()
    lr = fs.optim.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=2, decay_steps=5)
    if kind == "adamw":
        opt = fs.optim.adamw(lr, weight_decay=0.1)
    elif kind == "sgd":
        opt = fs.optim.sgd(lr, momentum=0.9, weight_decay=0.01)
    else:  # a schedule of the user's own, written with torch ops
        opt = fs.optim.sgd(lambda t: 0.05 * 0.5 ** (torch.as_tensor(t) / 2), momentum=0.9)
    step = _donated_step(model, buffers, opt)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        # lr: 0, 0.025, 0.05 (peak), then decaying to 0 at step 5
        _, (comp_p, comp_s) = _train_side_by_side(step, compiled, opt, sharded, steps)
    moved = any(not torch.equal(comp_p[k], sharded[k]) for k in sharded)
    return counter.frame_count, int(comp_s.count), moved


@pytest.mark.parametrize("kind", ["adamw", "sgd", "callable"])
def test_scheduled_step(world2, kind):
    assert world2.run(scheduled_step, kind) == [(1, 6, True)] * 2


def test_device_counts_ask_for_the_capturable_kernel_in_a_compiled_step(monkeypatch):
    """With the counts on the parameters' device (``capturable=True``) the compiled update runs
    torch's capturable kernel, with a schedule's lr as a tensor, as the eager step does there:
    so it reads nothing on the host and a CUDA graph can capture it. torch has no capturable
    kernel on CPU; here both torch's check and fs.optim's take the CPU as such a device, so
    the eager and the compiled step run that kernel. Equal to eager over 6 steps (4 weights, a
    warm-up then decay), compiled once."""
    import torch.optim.adam as torch_adam

    from funcshard.optim import _adam_sgd, _opaque

    devices = lambda *a, **k: ["cuda", "cpu"]
    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", devices)
    monkeypatch.setattr(_adam_sgd, "_get_capturable_supported_devices", devices)
    asked = []

    def spy(*args, **kwargs):
        asked.append((kwargs["capturable"], type(kwargs["lr"])))
        return torch_adam.adam(*args, **kwargs)

    monkeypatch.setattr(_opaque, "torch_adam", spy)
    # foreach: left to torch, a compiled step on CPU takes the fused kernel
    schedule = fs.optim.warmup_cosine_decay_schedule(0.0, 0.05, 2, 6)
    opt = fs.optim.adamw(schedule, capturable=True, foreach=True)
    gen = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(5, 3, generator=gen) for i in range(4)}
    step = lambda p, s, g: fs.optim.step(opt, p, g, s)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager = ({k: v.clone() for k, v in params.items()}, opt.init(params))
    ours = ({k: v.clone() for k, v in params.items()}, opt.init(params))
    for _ in range(6):
        grads = {k: torch.randn(5, 3, generator=gen) for k in params}
        eager = step(*eager, grads)
        del asked[:]
        ours = compiled(*ours, grads)
        assert asked == [(True, torch.Tensor)], asked  # the compiled step's kernel
        fs.testing.assert_close(ours, eager, atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1 and int(ours[1].count) == 6


def python_schedule():
    """A schedule that needs a Python number (math.cos of the count) under fullgraph: Dynamo's
    Unsupported, with funcshard's message naming the optimizer in a warning."""
    import math

    model, sharded, buffers = _setup()
    opt = fs.optim.sgd(lambda t: 0.1 * math.cos(t / 10))
    vg = fs.value_and_grad(
        lambda p, x, y: F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)
    )
    state = opt.init(sharded)
    step = torch.compile(lambda g, s, p: opt.update(g, s, p), backend="aot_eager", fullgraph=True)
    grads = vg(sharded, *_batch(0))[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step(grads, state, sharded)
            return "it compiled"
        except torch._dynamo.exc.Unsupported:
            pass
    return [str(w.message) for w in caught if "learning-rate schedule" in str(w.message)]


def test_python_schedule(world2):
    for messages in world2.run(python_schedule):
        assert len(messages) >= 1, messages
        assert "sgd: the learning-rate schedule" in messages[0]
        assert "must compute with torch ops" in messages[0]
        assert "fs.optim's schedules" in messages[0]
        assert "outside torch.compile" in messages[0]


# ---- the schedule in the graph -----------------------------------------------------------------


def _flat_numel(plan, sharded) -> dict[int, str]:
    """{numel of a group's all-gather input on this rank: group name}: the padded local pieces."""
    world = dist.get_world_size()
    out = {}
    for g in plan.groups:
        n = 0
        for p in g.params:
            shape = sharded[p].shape
            n += -(-shape[0] // world) * shape[1:].numel()
        out[n] = g.name
    assert len(out) == len(plan.groups), "groups must differ in size for this test"
    return out


# views and copies of a gathered buffer (auto_functionalized_v2: funcshard::copy_out, a group's
# full tensors copied into a buffer of the graph, see funcshard._communication._opaque)
_VIEWS = {"view", "_unsafe_view", "t", "permute", "slice", "split_with_sizes", "getitem",
          "clone", "reshape", "alias", "expand", "detach", "transpose", "as_strided",
          "auto_functionalized_v2"}  # fmt: skip


def _written(n) -> list:
    """The arguments that the node ``n`` writes in place (a mutating operator's ``out``)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    return [a for a, w in zip(n.args, written, strict=False) if w and isinstance(a, torch.fx.Node)]


def _events(graph, groups: dict[int, str]):
    """The graph's all-gathers and their waits, as (op, group), in graph order; and, for each
    group, the index of the last node that reads its first gather (through views and copies)."""
    nodes = list(graph.graph.nodes)
    events, gathered, first = [], {}, {}
    for n in nodes:
        name = getattr(n.target, "__name__", "").split(".")[0]
        if name == "all_gather_into_tensor":
            group = groups[n.args[0].meta["val"].numel()]
            events.append(("all_gather", group))
            gathered[n] = group
        elif name == "wait_tensor" and n.args[0] in gathered:
            group = gathered[n.args[0]]
            events.append(("wait", group))
            first.setdefault(group, n)
    last_use = {}
    for group, start in first.items():
        derived, last = {start}, nodes.index(start)
        for i, n in enumerate(nodes):
            if any(a in derived for a in n.all_input_nodes):
                last = i
                if getattr(n.target, "__name__", "").split(".")[0] in _VIEWS:
                    derived.add(n)
                derived.update(_written(n))  # fs.jit's graph: copy_out(out, gathered)
        last_use[group] = last
    return events, last_use, nodes


def _scheduled_graph(hidden, backend=None, **plan_kw):
    """A scheduled value_and_grad over blocks of widths ``hidden``, compiled (by default
    recording its graph), equal to eager for two batches: ``(plan, sharded, graph)``."""
    model, sharded, buffers = _setup(hidden=hidden)
    plan = fs.plan(model, fs.policy.by_type(Block), **plan_kw)
    apply = fs.schedule(model, plan)
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x, buffers=buffers), y))
    graphs = []
    compiled = torch.compile(vg, backend=backend or _recording(graphs), fullgraph=True)
    for i in range(2):
        x, y = _batch(i)
        fs.testing.assert_close(compiled(sharded, x, y), vg(sharded, x, y), **TOL)
    if backend is not None:
        return plan, sharded, None
    (graph,) = graphs  # one graph: forward and backward
    return plan, sharded, graph


def schedule_follows_plan(reshard: bool):
    """A compiled scheduled step: eager's values, and a graph whose gathers are the plan's
    all_gather/wait steps in order; with reshard_after_forward, the forward's gathered tensors
    are not read in backward (each block is gathered again there)."""
    plan, sharded, graph = _scheduled_graph((5, 6), reshard_after_forward=reshard)
    events, last_use, nodes = _events(graph, _flat_numel(plan, sharded))
    planned = [
        (s.op, s.group) for s in plan.forward + plan.backward if s.op in ("all_gather", "wait")
    ]
    # autograd seeds the backward with ones_like(loss): everything after it is backward
    backward_starts = next(i for i, n in enumerate(nodes) if "ones_like" in str(n.target))
    kept_out = {g: last_use[g] < backward_starts for g in last_use if g}
    return events == planned, events, planned, kept_out


def test_schedule_follows_plan(world2):
    for same, events, planned, kept_out in world2.run(schedule_follows_plan, True):
        assert same, (events, planned)
        assert planned.count(("all_gather", "blocks.0")) == 2  # forward, and again in backward
        assert all(kept_out.values()), kept_out
    for same, events, planned, kept_out in world2.run(schedule_follows_plan, False):
        assert same, (events, planned)
        assert planned.count(("all_gather", "blocks.0")) == 1
        assert not any(kept_out.values()), kept_out  # the control: kept until backward


def _custom_ops(graph) -> list[str]:
    """The funcshard operators of a graph, in order (mutating ones through
    auto_functionalized_v2, the way AOTAutograd records them)."""
    out = []
    for n in graph.graph.nodes:
        op = n.args[0] if n.target is torch.ops.higher_order.auto_functionalized_v2 else n.target
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "funcshard":
            out.append(op._opname)
    return out


def one_operation_per_group():
    """A compiled scheduled step over shards of the last dim, with sizes 2 ranks do not divide
    and a frozen parameter: equal to eager; each gather's copy-in and copy-out and each group's
    gradient copy is one operation of the graph, and AdamW's update a few (one per chunk of
    parameters), not code per tensor."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(hidden=(5, 6))
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()), lambda _, t: Shard(t.dim() - 1))
    sharded["inp.bias"].requires_grad_(False)
    model.to("meta")
    plan = fs.plan(model, fs.policy.by_type(Block))
    apply = fs.schedule(model, plan)
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x, buffers=buffers), y))
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)

    def step(params, state, x, y):
        loss, grads = vg(params, x, y)
        params, state = fs.optim.step(opt, params, grads, state)
        return loss, params, state

    graphs = []
    compiled = torch.compile(step, backend=_recording(graphs), fullgraph=True)
    _train_side_by_side(step, compiled, opt, sharded, 2)
    (graph,) = graphs
    ops = _custom_ops(graph)
    updates = sum("addcdiv" in str(n.target) for n in graph.graph.nodes)
    gathers = sum(s.op == "all_gather" for s in plan.forward + plan.backward)
    return {op: ops.count(op) for op in sorted(set(ops))}, gathers, len(plan.groups), updates


def test_one_operation_per_group(world2):
    for counts, gathers, groups, updates in world2.run(one_operation_per_group):
        assert gathers == 3 + 2  # the root and 2 blocks; the blocks again in backward
        assert counts["copy_in"] == counts["copy_out"] == gathers, counts
        assert counts["copy_grads"] == groups, counts
        assert 1 <= counts["adam_"] < 11, counts  # 11 trained parameter tensors
        assert updates == 0  # the update is torch's kernel, not traced per tensor


def compiled_loss_only():
    """torch.compile on the loss alone, value_and_grad outside: a forward and a backward graph;
    the backward one re-gathers the resharded blocks."""
    model, sharded, buffers = _setup(hidden=(5, 6))
    plan = fs.plan(model, fs.policy.by_type(Block))
    apply = fs.schedule(model, plan)
    graphs = []

    def loss_fn(p, x, y):
        return F.mse_loss(apply(p, x, buffers=buffers), y)

    compiled = fs.value_and_grad(torch.compile(loss_fn, backend=_recording(graphs), fullgraph=True))
    for i in range(2):
        x, y = _batch(i)
        fs.testing.assert_close(compiled(sharded, x, y), fs.value_and_grad(loss_fn)(sharded, x, y))
    gathers = [
        sum("all_gather" in str(n.target) for n in g.graph.nodes) for g in graphs
    ]  # forward graph, backward graph
    return gathers


def test_compiled_loss_only(world2):
    for gathers in world2.run(compiled_loss_only):
        assert gathers == [3, 2]  # root + 2 blocks; the 2 blocks again


def mixed_precision_hsdp():
    """param_dtype / reduce_dtype and a 2-D (replicate, shard) mesh, compiled."""
    model, sharded, buffers = _setup(2, 1)
    plan = fs.plan(model, fs.policy.by_type(Block))
    apply = fs.schedule(model, plan, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    vg = fs.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x, buffers=buffers).float(), y))
    compiled = torch.compile(vg, backend="aot_eager", fullgraph=True)
    x, y = _batch(0, dtype=torch.bfloat16)
    fs.testing.assert_close(compiled(sharded, x, y), vg(sharded, x, y))


def test_mixed_precision_hsdp(world2):
    world2.run(mixed_precision_hsdp)


# ---- torch.func, inductor, and never silently falling back -------------------------------------


def torch_func_transforms():
    """torch.func.grad and vmap(grad) over fs.to_local trees, compiled with fullgraph."""
    model, sharded, buffers = _setup()

    def loss_fn(p, x, y):
        return F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)

    def grads(p, x, y):
        return fs.from_local(torch.func.grad(loss_fn)(fs.to_local(p), x, y))

    def per_sample(p, x, y):
        each = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0, 0))
        out = each(fs.to_local(p), x.unsqueeze(1), y.unsqueeze(1))
        return {k: v.tensor for k, v in out.items()}

    x, y = _batch(0)
    for fn in (grads, per_sample):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        fs.testing.assert_close(compiled(sharded, x, y), fn(sharded, x, y), **TOL)


def test_torch_func_transforms(world2):
    world2.run(torch_func_transforms)


def torch_func_over_dtensors_refused():
    """A torch.func transform over the DTensor tree itself does not compile: every rank gets the
    same clear error (as a warning beside Dynamo's), before any collective; eager still works."""
    model, sharded, buffers = _setup()

    def loss_fn(p, x, y):
        return F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)

    x, y = _batch(0)
    compiled = torch.compile(torch.func.grad(loss_fn), backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled(sharded, x, y)
        except Exception as e:  # Dynamo's wrapper of ours
            error = type(e).__name__
        else:
            error = None
    eager = torch.func.grad(loss_fn)(sharded, x, y)  # the ranks are still in step
    reference = fs.value_and_grad(loss_fn)(sharded, x, y)[1]
    fs.testing.assert_close(eager, reference, **TOL)
    return error, [str(w.message) for w in caught if "do not compile" in str(w.message)]


def test_torch_func_over_dtensors_is_refused_on_every_rank(world2):
    for error, messages in world2.run(torch_func_over_dtensors_refused):
        assert error is not None
        assert messages and "fs.to_local(tree)" in messages[0], messages


def inductor_step():
    """A whole step compiled by inductor (C++ kernels), on the smallest model."""
    model, sharded, buffers = _setup()
    opt = fs.optim.sgd(0.1)
    step = _donated_step(model, buffers, opt)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    _train_side_by_side(step, compiled, opt, sharded, 2)


def test_inductor(world2):
    world2.run(inductor_step)


def inductor_step_clipped():
    """The same with global-norm clipping (its norm all-reduced inside the compiled step), at a
    norm small enough that every step clips: eager's steps."""
    model, sharded, buffers = _setup()
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1e-3), fs.optim.sgd(0.1))
    step = _donated_step(model, buffers, opt)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    _train_side_by_side(step, compiled, opt, sharded, 2)


def test_inductor_with_clipping(world2):
    world2.run(inductor_step_clipped)


def inductor_scheduled():
    """A scheduled value_and_grad compiled by inductor, over two identical blocks (one
    subgraph, called twice: see funcshard/_execution/_regions.py): eager's values and gradients."""
    _scheduled_graph((3, 3), backend="inductor")


def test_inductor_scheduled(world2):
    world2.run(inductor_scheduled)


def no_silent_fallback():
    """What cannot be compiled raises instead of falling back to eager: a new input shape under
    error_on_recompile; SGD momentum with dampening (its first step is special) under fullgraph,
    with funcshard's own message in a warning. Two transforms compiled directly do not share
    Dynamo's cache."""
    model, sharded, buffers = _setup()
    vg = fs.value_and_grad(
        lambda p, x, y: F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)
    )
    compiled = torch.compile(vg, backend="aot_eager", fullgraph=True)
    compiled(sharded, *_batch(0))
    problems = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        try:
            compiled(sharded, *_batch(1, n=5))
            problems.append("no RecompileError for a new batch size")
        except torch._dynamo.exc.RecompileError:
            pass
    # two transforms compiled directly: each its own graph (Dynamo caches by code object)
    twice = fs.value_and_grad(
        lambda p, x, y: 2 * F.mse_loss(fs.functional_call(model, (fs.unshard(p), buffers), (x,)), y)
    )
    x, y = _batch(0)
    value = compiled(sharded, x, y)[0]
    if not torch.equal(torch.compile(twice, backend="aot_eager")(sharded, x, y)[0], 2 * value):
        problems.append("a second transform compiled reused the first one's graph")
    opt = fs.optim.sgd(0.1, momentum=0.9, dampening=0.5)
    state = opt.init(sharded)
    step = torch.compile(lambda g, s, p: opt.update(g, s, p), backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step(vg(sharded, *_batch(0))[1], state, sharded)
            problems.append("dampening compiled")
        except torch._dynamo.exc.Unsupported:
            pass
    if not any("momentum with dampening" in str(w.message) for w in caught):
        problems.append(f"no warning naming dampening: {[str(w.message) for w in caught]}")
    return problems


def test_no_silent_fallback(world2):
    assert world2.run(no_silent_fallback) == [[], []]


def created_inside():
    """A transform made inside the compiled function: funcshard's message is the first line of
    the error, with fullgraph=True and with the default (where Dynamo would break the graph and
    inductor fail on the closure's tensors); raised while tracing, before any collective."""
    model, sharded, buffers = _setup()

    def step(p, x, y):
        loss = lambda q: F.mse_loss(fs.functional_call(model, (fs.unshard(q), buffers), (x,)), y)
        return fs.value_and_grad(loss)(p)

    firsts = []
    for fullgraph, backend in ((True, "aot_eager"), (False, "inductor")):
        try:
            torch.compile(step, backend=backend, fullgraph=fullgraph)(sharded, *_batch(0))
            firsts.append("no error")
        except RuntimeError as e:
            firsts.append(str(e).splitlines()[0])
    return firsts


def test_a_transform_created_inside_is_refused_with_our_message_first(world2):
    for firsts in world2.run(created_inside):
        for first in firsts:
            assert first.startswith(
                "RuntimeError: funcshard: <lambda> was created inside a function that "
                "torch.compile is compiling."
            ), firsts


# ---- identical groups compiled once (funcshard/_execution/_regions.py) ------------------------


def _mm_ops(graph) -> list[str]:
    return [str(n.target) for n in graph.graph.nodes if "mm" in str(n.target)]


def identical_groups():
    """A compiled scheduled step over blocks of widths (5, 5, 6): eager's values; the blocks run
    as invoke_subgraph calls, the two identical ones through one forward and one backward
    subgraph, and the backward subgraphs compute no forward matmul again."""
    _, _, graph = _scheduled_graph((5, 5, 6))
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    subgraphs = [n.args[0].target for n in calls]
    ops = {name: _mm_ops(getattr(graph, name)) for name in set(subgraphs)}
    return [n.args[1] for n in calls], subgraphs, ops


def test_identical_groups_share_their_subgraphs(world2):
    for identifiers, subgraphs, ops in world2.run(identical_groups):
        forward = [s for s, i in zip(subgraphs, identifiers, strict=True) if i.endswith("_forward")]
        backward = [
            s for s, i in zip(subgraphs, identifiers, strict=True) if i.endswith("_backward")
        ]
        assert len(forward) == len(backward) == 3
        assert forward[0] == forward[1] != forward[2]  # blocks 0 and 1 share, block 2 not
        assert backward[0] != backward[1] == backward[2]  # backward runs block 2 first
        for name in forward:
            assert ops[name] == ["aten.addmm.default"] * 2
        for name in backward:  # gradients of the inputs and weights, no forward recomputed
            assert ops[name] == ["aten.mm.default"] * 4


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5)


class Attending(nn.Module):
    """Self-attention over the batch's rows; ``dropout_p``: SDPA's own dropout."""

    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.qkv, self.dropout_p = nn.Linear(8, 24), dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)[0]


def random_groups_inline(block: Callable[[], nn.Module]):
    """Whether the step's graph calls regions, with two blocks made by ``block``."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), block(), block(), nn.Linear(8, 1))
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    kind = type(model[1])
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(kind)))
    vg = fs.value_and_grad(lambda p, x: apply(p, x, buffers=buffers).square().mean())
    graphs = []
    torch.compile(vg, backend=_recording(graphs), fullgraph=True)(sharded, _batch(0)[0])
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes]
    return torch.ops.higher_order.invoke_subgraph in targets, len(targets)


@pytest.mark.parametrize(
    "block, regions",
    [
        (Dropped, False),  # dropout: traced inline (one shared subgraph would reuse one mask)
        (functools.partial(Attending, 0.25), False),  # attention's own dropout: likewise
        (functools.partial(Attending, 0.0), True),  # attention without dropout draws nothing
    ],
)
def test_random_groups_are_not_regions(world2, block, regions):
    for got, nodes in world2.run(random_groups_inline, block):
        assert got == regions and nodes > 0


def test_private_torch_apis_of_regions():
    """What funcshard/_execution/_regions.py relies on (torch's invoke_subgraph and its joint
    tracing, the min-cut partitioner): a region's joint graph, partitioned, gives the forward's
    values and the gradients of eager. Fails on a torch upgrade that changes them."""
    from funcshard._execution._regions import _partition

    block = Block(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    tensors = [x, *block.parameters()]

    names = [n for n, _ in block.named_parameters()]

    def fn(x, *params):
        return (torch.func.functional_call(block, dict(zip(names, params, strict=True)), (x,)),)

    from torch._higher_order_ops.invoke_subgraph import trace_joint_graph_as_bwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t).requires_grad_() for t in tensors]
        tangent = torch.empty(2, 4)
        keys = (
            torch._C._dispatch_tls_local_include_set(),
            torch._C._dispatch_tls_local_exclude_set(),
        )
        joint = trace_joint_graph_as_bwd(fn, len(fakes), [*fakes, tangent], *keys)
    graphs = _partition(joint, len(tensors), ((torch.Size([2, 4]), x.dtype, x.device),), "r")
    assert graphs is not None
    out, *extra = graphs.forward(*[t.detach() for t in tensors])
    expected = fn(x, *block.parameters())[0]
    torch.testing.assert_close(out, expected)
    grad = torch.randn(2, 4)
    saved = [tensors[i].detach() if k == "input" else extra[i] for k, i in graphs.saved]
    found = graphs.backward(*saved, grad)
    torch.testing.assert_close(found, torch.autograd.grad(expected, tensors, grad))


def test_private_torch_apis_of_compat():
    """What funcshard/_runtime/_compat.py's ``compiling()`` relies on (on torch 2.11 and 2.12: the
    TracingContext Dynamo installs while it compiles): true in a nonstrict_trace function while
    Dynamo and AOTAutograd trace it and in the backward AOTAutograd traces, false eagerly and
    while the compiled graph runs. Fails on a torch upgrade that changes it."""
    from funcshard._runtime._compat import compiling

    seen = []

    class Seen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", compiling()))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", compiling()))
            return g * 2

    @torch._dynamo.nonstrict_trace
    def body(x):
        seen.append(("body", compiling()))
        return Seen.apply(x) + 1

    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    compiled = torch.compile(body, backend="aot_eager", fullgraph=True)
    compiled(x).sum().backward()
    assert {where for where, _ in seen} == {"body", "forward", "backward"}, seen
    assert all(inside for _, inside in seen), seen
    seen.clear()
    compiled(x).sum().backward()  # the compiled graphs: none of the Python runs
    assert seen == []
    body(x).sum().backward()  # eagerly
    assert seen == [("body", False), ("forward", False), ("backward", False)]
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0))


def test_private_torch_api_of_storage_key():
    """What funcshard/_runtime/_compat.py's ``storage_key`` relies on (``UntypedStorage._cdata``):
    one key for a tensor and its views, another for another tensor, distinct for fake tensors
    (whose data pointers are all 0), and stable while a storage is emptied and refilled. Fails
    on a torch upgrade that changes it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from funcshard._runtime._compat import storage_key

    a, b = torch.zeros(4), torch.zeros(4)
    assert storage_key(a) == storage_key(a.view(2, 2)) == storage_key(a.untyped_storage())
    assert storage_key(a) != storage_key(b)
    key = storage_key(a)
    a.untyped_storage().resize_(0)
    a.untyped_storage().resize_(16)
    assert storage_key(a) == key
    with FakeTensorMode():
        c, d = torch.empty(4), torch.empty(4)
        assert storage_key(c) != storage_key(d)
        assert storage_key(c[1:]) == storage_key(c)
