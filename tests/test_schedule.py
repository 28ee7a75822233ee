"""schedule(module, plan): the same values and gradients as the unscheduled path, with FSDP2's
communication and memory behaviour, and no hooks."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.func import grad, vmap
from torch.profiler import ProfilerActivity, profile

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes, span

from _comm import Collectives, counts
from _mesh import mesh
from _models import Block, Wide, WideBlock, lm_loss, make, reference_step, shard_of, tokens


def _setup(mesh_shape=None, layers=2, batchnorm=True, **plan_kw):
    world = dist.get_world_size()
    model = make(layers=layers, batchnorm=batchnorm)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(*(mesh_shape or (world,))))
    plan = fs.plan(model, fs.policy.by_type(Block), **plan_kw)
    model.to("meta")
    return model, sharded, {k: v.clone() for k, v in buffers.items()}, plan


def _err(grads, ref):
    return max(
        (g.to_local() - shard_of(ref[k], g)).abs().max().item()
        for k, g in grads.items()
        if g.to_local().numel()
    )


def parity(mesh_shape, prefetch, reshard):
    """Scheduled step vs the unsharded reference and vs the unscheduled unshard path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup(
        mesh_shape, prefetch=prefetch, backward_prefetch=prefetch, reshard_after_forward=reshard
    )
    batch = tokens(rank)
    apply = fs.schedule(model, plan)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="funcshard")
        with CommDebugMode() as comm:
            loss, grads = fs.value_and_grad(
                lambda p: lm_loss(apply(p, batch, buffers=buffers), batch)
            )(sharded)
    unsched_buffers = {k: v.clone() for k, v in buffers.items()}
    loss_u, grads_u = fs.value_and_grad(
        lambda p: lm_loss(
            fs.functional_call(model, (fs.unshard(p), unsched_buffers), (batch,)), batch
        )
    )(sharded)
    ref_loss, ref, _ = reference_step(make(), [tokens(r) for r in range(world)])
    mean = loss.clone()
    dist.all_reduce(mean)
    return {
        "ref": max(_err(grads, ref), abs(mean.item() / world - ref_loss.item())),
        "unscheduled": max(
            _err(grads, {k: v.full_tensor() for k, v in grads_u.items()}),
            abs(loss.item() - loss_u.item()),
        ),
        "counts": counts(comm),
        "groups": len(plan.groups),
    }


def _check(results, reshard, hsdp=False):
    for r in results:
        assert r["ref"] < 1e-5 and r["unscheduled"] < 1e-6, r
        g = r["groups"]
        expected = {
            "all_gather": 2 * g - 1 if reshard else g,
            "reduce_scatter": g,
        }
        if hsdp:
            expected["all_reduce"] = g
        assert r["counts"] == expected, r


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("reshard", [True, False])
def test_parity_2_ranks(world2, prefetch, reshard):
    _check(world2.run(parity, None, prefetch, reshard), reshard)


@pytest.mark.parametrize(("prefetch", "reshard"), [(1, True), (0, False), (2, True)])
def test_parity_4_ranks(world4, prefetch, reshard):
    _check(world4.run(parity, None, prefetch, reshard), reshard)


@pytest.mark.parametrize(("prefetch", "reshard"), [(1, True), (2, False)])
def test_parity_hsdp(world4, prefetch, reshard):
    _check(world4.run(parity, (2, 2), prefetch, reshard), reshard, hsdp=True)


_HOOK_APIS = [
    (nn.Module, "register_forward_pre_hook"),
    (nn.Module, "register_forward_hook"),
    (nn.Module, "register_full_backward_pre_hook"),
    (nn.Module, "register_full_backward_hook"),
    (nn.Module, "register_backward_hook"),
    (torch.Tensor, "register_hook"),
    (torch.Tensor, "register_post_accumulate_grad_hook"),
    (torch.nn.modules.module, "register_module_forward_pre_hook"),
    (torch.nn.modules.module, "register_module_forward_hook"),
    (torch.nn.modules.module, "register_module_full_backward_pre_hook"),
    (torch.nn.modules.module, "register_module_full_backward_hook"),
    (torch.nn.modules.module, "register_module_backward_hook"),
    (torch.autograd.graph, "register_multi_grad_hook"),
]


class _Probe(nn.Module):
    """Checks, in the middle of the forward, that no module or global hook is installed."""

    def __init__(self, root):
        super().__init__()
        self.root = [root]

    def forward(self, x):
        m = torch.nn.modules.module
        globals_ = [
            m._global_forward_pre_hooks,
            m._global_forward_hooks,
            m._global_backward_hooks,
            m._global_backward_pre_hooks,
        ]
        modules = [
            (n, mod)
            for n, mod in self.root[0].named_modules()
            if mod._forward_pre_hooks
            or mod._forward_hooks
            or mod._backward_hooks
            or mod._backward_pre_hooks
        ]
        assert not any(globals_) and not modules, (globals_, modules)
        return x


def no_hooks():
    rank = dist.get_rank()
    calls = []
    saved = [(owner, name, getattr(owner, name)) for owner, name in _HOOK_APIS]
    for owner, name, fn in saved:

        def spy(*a, _name=name, _fn=fn, **k):
            calls.append(_name)
            return _fn(*a, **k)

        setattr(owner, name, spy)
    try:
        model = make()
        model.norm = nn.Sequential(model.norm, _Probe(model))
        params, buffers = fs.extract(model)
        sharded = fs.shard(params, mesh(dist.get_world_size()))
        plan = fs.plan(model, fs.policy.by_type(Block), example_args=(tokens(rank),))
        apply = fs.schedule(model, plan)
        batch = tokens(rank)
        fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=buffers), batch))(sharded)
        with torch.no_grad():
            apply(sharded, batch, buffers=buffers)
        grad(lambda p, bufs: lm_loss(apply(p, batch, buffers=bufs), batch))(
            fs.to_local(sharded), buffers
        )
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return calls


def test_no_hooks_are_registered(world2):
    assert world2.run(no_hooks) == [[], []]


def out_of_order():
    """A plan whose order is wrong for this forward: the use it cannot serve without a gather
    of its own is named on every rank (a warning at once, an error at the next call), and the
    ranks stay in step: the right plan then gives the unsharded model's gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup()
    wrong = plan.replace(order=("", "blocks.1", "blocks.0", ""))
    batch = tokens(rank)
    step = lambda p, plan: lm_loss(fs.schedule(model, plan)(p, batch, buffers=buffers), batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fs.value_and_grad(step)(sharded, wrong)
    messages = [str(w.message) for w in caught if "funcshard" in str(w.message)]
    try:
        fs.value_and_grad(step)(sharded, plan)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    _, grads = fs.value_and_grad(step)(sharded, plan)
    _, ref, _ = reference_step(make(), [tokens(r) for r in range(world)])
    return _err(grads, ref), messages, raised


def test_out_of_order_use_is_named_on_every_rank_and_they_stay_in_step(world2):
    for rank, (err, messages, raised) in enumerate(world2.run(out_of_order)):
        assert err < 1e-5
        assert len(messages) == 1 and f"rank {rank}'s forward used group 'blocks." in messages[0]
        assert raised is not None and raised in messages[0], raised
        assert "the plan's last run of it had passed" in raised and "order=" in raised


def accumulate(micro):
    """sync_grads=False for every micro-batch (no reduce-scatter), then one fs.reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup()
    apply = fs.schedule(model, plan)
    acc, during = None, {}
    for step in range(micro):  # one CommDebugMode per step: its module tracker spans one pass
        batch = tokens(rank, step=step)
        with CommDebugMode() as comm:
            _, full = fs.value_and_grad(
                lambda p, b=batch: lm_loss(apply(p, b, buffers=buffers), b), sync_grads=False
            )(sharded)
        for k, v in counts(comm).items():
            during[k] = during.get(k, 0) + v
        acc = full if acc is None else fs.tree_map(torch.add, acc, full)
    with CommDebugMode() as comm:
        grads = fs.reduce(fs.tree_map(lambda g: g / micro, acc), like=sharded)
    ref = None
    for step in range(micro):
        _, g, _ = reference_step(make(), [tokens(r, step=step) for r in range(world)])
        ref = g if ref is None else {k: ref[k] + g[k] for k in g}
    ref = {k: v / micro for k, v in ref.items()}
    full_shapes = all(acc[k].shape == sharded[k].shape for k in acc)
    return _err(grads, ref), during, counts(comm), full_shapes


def test_accumulation_without_communication(world2):
    for err, during, final, full_shapes in world2.run(accumulate, 3):
        assert err < 1e-5 and full_shapes
        assert "reduce_scatter" not in during
        assert final == {"reduce_scatter": 1}


def two_forwards():
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup()
    apply = fs.schedule(model, plan)
    a, b = tokens(rank, step=0), tokens(rank, step=1)

    def loss(p):
        return lm_loss(apply(p, a, buffers=buffers), a) + lm_loss(apply(p, b, buffers=buffers), b)

    _, grads = fs.value_and_grad(loss)(sharded)
    _, ra, _ = reference_step(make(), [tokens(r, step=0) for r in range(world)])
    _, rb, _ = reference_step(make(), [tokens(r, step=1) for r in range(world)])
    return _err(grads, {k: ra[k] + rb[k] for k in ra})


def test_forward_twice_in_one_step(world2):
    assert max(world2.run(two_forwards)) < 1e-5


def under_torch_func():
    """torch.func.grad and vmap(grad) through a schedule (no frees there, still correct)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup()
    apply = fs.schedule(model, plan)
    batch = tokens(rank)

    def loss(p, bufs, b):
        return lm_loss(apply(p, b, buffers=bufs), b)

    grads = fs.from_local(grad(loss)(fs.to_local(sharded), buffers, batch))
    _, ref, _ = reference_step(make(), [tokens(r) for r in range(world)])
    # per-example gradients (a batch of one each) under vmap, against a loop
    model_nb, sharded_nb, _, plan_nb = _setup(batchnorm=False)
    apply_nb = fs.schedule(model_nb, plan_nb)
    local = fs.to_local(sharded_nb)

    def one(p, seq):
        return lm_loss(apply_nb(p, seq[None]), seq[None])

    per_example = vmap(grad(one), in_dims=(None, 0))(local, batch[:, :4])
    loop = [grad(one)(local, seq) for seq in batch[:, :4]]
    vmap_err = max(
        (per_example[k].tensor[i] - loop[i][k].tensor).abs().max().item()
        for k in per_example
        for i in range(len(loop))
    )
    return _err(grads, ref), vmap_err


def test_schedule_under_torch_func(world2):
    for err, vmap_err in world2.run(under_torch_func):
        assert err < 1e-5 and vmap_err < 1e-5


def memory(prefetch, reshard, mode):
    """Peak bytes above the start, over one block's full parameter bytes."""
    torch.manual_seed(0)
    model = Wide(layers=10)
    params, _ = fs.extract(model)
    world = dist.get_world_size()
    sharded = fs.shard(params, mesh(world))
    plan = fs.plan(
        model, fs.policy.by_type(WideBlock), prefetch=prefetch, reshard_after_forward=reshard
    )
    model.to("meta")
    apply = fs.schedule(model, plan)
    block = sum(params[p].numel() * 4 for p in plan.groups[1].params)
    x = torch.randn(1, 4)
    if mode == "forward":
        with torch.no_grad():
            peak, _ = peak_bytes(lambda: apply(sharded, x))
    else:  # this thread's own allocations: deterministic, whatever gloo's threads are doing
        step = lambda: fs.value_and_grad(lambda p: apply(p, x).sum())(sharded)
        peak, _ = peak_bytes(step, this_thread=True)
    return peak / block, world


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_forward_memory_stays_in_the_prefetch_window(world2, prefetch):
    """Forward peak, in full blocks: the 1 + prefetch groups unsharded or in flight (each
    gather holding its output and its 1/W input), one copy-out transient (the gathered buffer
    and the copies made from it), and gloo's own full-size temporary for a collective in
    flight; 0.25 for the root group and the activations."""
    peak, world = world2.run(memory, prefetch, True, "forward")[0]
    bound = (1 + prefetch) * (1 + 1 / world) + 1 + 1 + 0.25
    assert peak <= bound, (peak, bound)
    kept, _ = world2.run(memory, prefetch, False, "forward")[0]
    assert kept >= 10 > bound  # without resharding, all 10 blocks stay unsharded


def test_step_memory_below_unsharded(world2):
    """A whole step's peak (this thread's allocations), in full blocks: the 10 blocks' sharded
    gradients (10 / W) plus, in backward, at most 4 full blocks -- the group computing, its full
    gradient, the next group's prefetch buffer and the previous group until its post-backward
    free -- a 1/W prefetch input, and, when the prefetch is still in flight at that moment,
    gloo's full-size receive buffer, which its worker allocates on this thread's behalf
    (BENCHMARKS.md section 15: timing, one block or none). Without resharding all 10 blocks
    stay unsharded."""
    peak, world = world2.run(memory, 1, True, "step")[0]
    kept, _ = world2.run(memory, 1, False, "step")[0]
    assert peak <= 10 / world + 5 + 1 / world and kept >= 10 and peak < kept, (peak, kept)


def trace(prefetch):
    rank = dist.get_rank()
    model, sharded, buffers, plan = _setup(layers=3, prefetch=prefetch, backward_prefetch=prefetch)
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=buffers), batch))(sharded)
    events = sorted(
        (e.start_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.name().startswith("funcshard::")
    )
    return [name for _, name in events]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_profiler_shows_the_schedule_and_overlap(world2, prefetch):
    names = world2.run(trace, prefetch)[0]
    for g in ("blocks.0", "blocks.1", "blocks.2"):
        for op in (
            "all_gather",
            "wait",
            "forward",
            "free",
            "backward",
            "reduce_scatter",
            "wait_reduce_scatter",
        ):
            assert f"funcshard::{op} ({g})" in names, (op, g, names)
    for later, earlier in (("blocks.2", "blocks.1"), ("blocks.1", "blocks.0")):
        issued = names.index(f"funcshard::reduce_scatter ({later})")
        next_backward = names.index(f"funcshard::backward ({earlier})")
        waited = names.index(f"funcshard::wait_reduce_scatter ({later})")
        # the reduce-scatter of a group is issued when its backward ends, runs during the
        # backward of the group before it, and is waited for only then
        assert issued < next_backward < waited, names


def frees(mesh_shape, variant):
    """The profiler's free ranges of one step, by group; ``variant``: how gradients are asked
    for (``None``: the default)."""
    rank = dist.get_rank()
    model, sharded, buffers, plan = _setup(mesh_shape, layers=3)
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    loss = lambda p: lm_loss(apply(p, batch, buffers=buffers), batch)
    kw = {
        None: {},
        "sync_grads": {"sync_grads": False},
        "grad_placements": {"grad_placements": fs.optim.state_placements},
    }[variant]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fs.value_and_grad(loss, **kw)(sharded)
    names = [e.name() for e in prof.profiler.kineto_results.events()]
    return collections.Counter(n for n in names if n.startswith("funcshard::free"))


@pytest.mark.parametrize(
    ("world", "mesh_shape", "variant"),
    [("world2", None, "sync_grads"), ("world4", (2, 2), "grad_placements")],
)
def test_every_group_is_freed_after_its_backward(request, world, mesh_shape, variant):
    """sync_grads=False asks autograd for the gradients of the full tensors themselves (the
    engine stops there), ZeRO-2 (grad_placements, HSDP) takes them into its own node: each
    group's post-backward callback still runs and frees it, as by default; the blocks are
    freed after forward and after backward."""
    ranks = request.getfixturevalue(world)
    default, other = ranks.run(frees, mesh_shape, None)[0], ranks.run(frees, mesh_shape, variant)[0]
    assert other == default, (default, other)
    assert all(default[f"funcshard::free (blocks.{i})"] == 2 for i in range(3)), default


def test_profiler_ranges_only_under_a_profiler():
    """[Note: profiler ranges only under a profiler]: without a profiler, one shared no-op (no
    range, no label formatted); with one, ``record_function`` ranges under funcshard's names."""
    assert span("wait", "blocks.0") is span("free", "blocks.1")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert span("wait", "blocks.0") is not span("free", "blocks.1")
        with span("wait", "blocks.0"), span("free", "blocks.1"):
            torch.ones(2).add_(1)
    names = {e.name() for e in prof.profiler.kineto_results.events()}
    assert {"funcshard::wait (blocks.0)", "funcshard::free (blocks.1)"} <= names
    assert span("wait", "blocks.0") is span("free", "blocks.1")


def batchnorm_in_bf16():
    """TinyLM (a BatchNorm1d after the blocks) scheduled with bf16 parameters: the plan keeps
    BatchNorm in float32; values and gradients are close to the float32 reference, and the wire
    carries bf16 for the other groups and float32 for BatchNorm's."""
    from _comm import Collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(layers=2)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fs.plan(
            model,
            fs.policy.by_type(Block),
            example_args=(tokens(rank),),
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
        )
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    rec = Collectives()
    with rec, warnings.catch_warnings():
        warnings.simplefilter("error")  # the recorded plan is followed: no out-of-plan gather
        loss, grads = fs.value_and_grad(
            lambda p: lm_loss(apply(p, batch, buffers=buffers).float(), batch)
        )(sharded)
    ref_loss, ref, _ = reference_step(make(layers=2), [tokens(r) for r in range(world)])
    mean = loss.clone()
    dist.all_reduce(mean)
    gathered = {dtype for kind, dtype, n in rec.sent if kind == "all_gather" and n}
    bn_local = sum(-(-params[p].numel() // world) for p in ("bn.weight", "bn.bias"))  # per rank
    bn_wire = {d for kind, d, n in rec.sent if kind == "all_gather" and n == bn_local}
    return {
        "warned": any("BatchNorm" in str(w.message) for w in caught),
        "loss": abs(mean.item() / world - ref_loss.item()),
        "grads": _err(grads, ref),
        "dtypes": gathered,
        "bn_wire": bn_wire,
    }


def test_batchnorm_under_bf16_matches_fp32_reference(world2):
    for r in world2.run(batchnorm_in_bf16):
        assert r["warned"]
        assert r["loss"] < 2e-2 and r["grads"] < 2e-2, r
        assert r["dtypes"] == {torch.bfloat16, torch.float32}, r
        assert r["bn_wire"] == {torch.float32}, r


def regathered(dim):
    """Reshard after forward, then re-gathered for backward: refilled exactly, whatever the shard
    dim and whether the sizes divide (padding) or not."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 6))
    params, _ = fs.extract(net)
    sharded = fs.shard(
        params, mesh(dist.get_world_size()), lambda p, t: Shard(dim) if t.dim() == 2 else None
    )
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    apply = fs.schedule(net, fs.plan(net, fs.policy.by_type(nn.Linear)))
    _, grads = fs.value_and_grad(lambda p: F.mse_loss(apply(p, x), x))(sharded)
    _, expected = fs.value_and_grad(
        lambda p: F.mse_loss(fs.functional_call(net, fs.unshard(p), (x,)), x)
    )(sharded)
    return max((grads[k].to_local() - expected[k].to_local()).abs().max().item() for k in grads)


@pytest.mark.parametrize("dim", [0, 1])
def test_regathered_parameters_are_refilled_exactly(world2, dim):
    assert world2.run(regathered, dim) == [0.0, 0.0]


def per_structure_cache():
    """The per-structure state of a call (layouts, options, agreement) is reused only for the
    same structure: other dtypes, frozen leaves, plans and meshes get their own, and the cache
    stays bounded."""
    from funcshard._execution import _schedule

    rank = dist.get_rank()
    model, sharded, buffers, plan = _setup(batchnorm=False)
    batch = tokens(rank)
    apply = fs.schedule(model, plan)
    loss = lambda p: lm_loss(apply(p, batch, buffers=buffers), batch)
    _schedule._STATIC.clear()
    v1, g1 = fs.value_and_grad(loss)(sharded)
    v2, g2 = fs.value_and_grad(loss)(sharded)
    out = {"same": len(_schedule._STATIC) == 1 and v1.item() == v2.item()}
    out["same"] &= all(torch.equal(g1[k].to_local(), g2[k].to_local()) for k in g1)
    # a frozen leaf: a new structure, and no gradient for it
    name = next(iter(sharded))
    frozen = {k: v.detach().requires_grad_(k != name) for k, v in sharded.items()}
    _, gf = fs.value_and_grad(loss)(frozen)
    out["frozen"] = gf[name] is None and len(_schedule._STATIC) == 2
    # another dtype: a new structure, computing in bf16
    half = {k: v.detach().to(torch.bfloat16).requires_grad_() for k, v in sharded.items()}
    _, gh = fs.value_and_grad(loss)(half)
    out["dtype"] = gh[name].dtype == torch.bfloat16 and len(_schedule._STATIC) == 3
    # another mesh object (equal, same ranks): its own entry, holding its own mesh
    from torch.distributed.device_mesh import init_device_mesh

    fresh = init_device_mesh("cpu", (dist.get_world_size(),))
    other = fs.shard({k: v.full_tensor() for k, v in sharded.items()}, fresh)
    _, go = fs.value_and_grad(loss)(other)
    out["mesh"] = len(_schedule._STATIC) == 4 and all(
        torch.equal(go[k].to_local(), g1[k].to_local()) for k in g1
    )
    # another plan over the same tree
    apply2 = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block), prefetch=0))
    fs.value_and_grad(lambda p: lm_loss(apply2(p, batch, buffers=buffers), batch))(sharded)
    out["plan"] = len(_schedule._STATIC) == 5
    # bounded
    size, _schedule._STATIC_SIZE = _schedule._STATIC_SIZE, 2
    try:
        last = next(reversed(sharded))
        fs.value_and_grad(loss)(
            {k: v.detach().requires_grad_(k != last) for k, v in sharded.items()}
        )
        out["bounded"] = len(_schedule._STATIC) == 2
    finally:
        _schedule._STATIC_SIZE = size
    return out


def test_per_structure_cache(world2):
    for r in world2.run(per_structure_cache):
        assert all(r.values()), r


def dtensor_and_shard_gradients_add():
    """A DTensor used both through schedule (its local shard is differentiated directly) and by
    DTensor code in the loss gets the sum of both gradients, as before."""
    rank = dist.get_rank()
    model, sharded, buffers, plan = _setup()
    batch = tokens(rank)
    apply = fs.schedule(model, plan)
    name = next(iter(sharded))

    def loss(p, extra):
        value = lm_loss(apply(p, batch, buffers=buffers), batch)
        return value + extra * (p[name] * p[name]).sum().full_tensor()

    _, g0 = fs.value_and_grad(loss)(sharded, 0.0)
    _, g1 = fs.value_and_grad(loss)(sharded, 0.5)
    want = g0[name].to_local() + sharded[name].to_local().detach()
    return {
        "sum": torch.allclose(g1[name].to_local(), want, atol=1e-6),
        "dtensor": type(g1[name]).__name__ == "DTensor"
        and g1[name].placements == g0[name].placements,
    }


def test_dtensor_and_shard_gradients_add(world2):
    for r in world2.run(dtensor_and_shard_gradients_add):
        assert all(r.values()), r


def one_rank_step():
    """A scheduled step, unshard and reduce on one rank: no collective; values as unsharded."""
    model, sharded, buffers, plan = _setup()
    batch = tokens(0)
    ref_loss, ref, _ = reference_step(make(layers=2), [batch])
    apply = fs.schedule(model, plan)
    with Collectives() as comm:
        loss, grads = fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=buffers), batch))(
            sharded
        )
        full = fs.unshard(sharded)
        fs.reduce({k: torch.ones_like(v) for k, v in full.items()}, sharded)
    return len(comm.sent), (loss - ref_loss).abs().item(), _err(grads, ref)


def test_world_size_one_issues_no_collectives(world1):
    """As FSDP2 at world size 1 (see [Note: one rank communicates nothing])."""
    sent, loss_err, grad_err = world1.run(one_rank_step)[0]
    assert sent == 0
    assert loss_err < 1e-6 and grad_err < 1e-6


def one_rank_bf16():
    """One rank, bf16 compute and fp32 reduction: the full tensors are the shards cast (no flat
    buffer); each step's loss and gradients equal the unsharded model's in bf16, and the shards
    are untouched by the frees of reshard-after-forward."""
    model, sharded, buffers, plan = _setup(batchnorm=False)
    batch = tokens(0)
    ref_model = make(layers=2, batchnorm=False).to(torch.bfloat16)
    ref_loss = lm_loss(ref_model(batch), batch)
    ref_loss.backward()
    ref = {k: p.grad.float() for k, p in ref_model.named_parameters()}
    before = {k: v.to_local().clone() for k, v in sharded.items()}
    apply = fs.schedule(model, plan, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    step = fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=buffers), batch))
    results = [step(sharded) for _ in range(2)]
    kept = all(torch.equal(v.to_local(), before[k]) for k, v in sharded.items())
    # fp32 compute, bf16 reduction: the gradient rounded to bf16, as a reduce-scatter in bf16
    fp32 = make(layers=2, batchnorm=False)
    lm_loss(fp32(batch), batch).backward()
    rounded = {k: p.grad.to(torch.bfloat16).float() for k, p in fp32.named_parameters()}
    narrow = fs.schedule(model, plan, reduce_dtype=torch.bfloat16)
    _, grads = fs.value_and_grad(lambda p: lm_loss(narrow(p, batch, buffers=buffers), batch))(
        sharded
    )
    return (
        [(loss.float() - ref_loss.float()).abs().item() for loss, _ in results],
        [_err(grads, ref) for _, grads in results],
        {str(g.dtype) for _, grads in results for g in grads.values()},
        kept,
        _err(grads, rounded),
    )


def test_world_size_one_casts_without_gathering(world1):
    loss_errs, grad_errs, dtypes, kept, rounded_err = world1.run(one_rank_bf16)[0]
    assert max(loss_errs) == 0.0 and max(grad_errs) < 1e-6, (loss_errs, grad_errs)
    assert dtypes == {"torch.float32"} and kept
    assert rounded_err == 0.0
