"""The CUDA path (NCCL, streams, bf16) on the GPUs of the machine; skipped where there are none.

CI has no GPU: these run on machines that have one (e.g. the device tool's H100/H200).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

from _mesh import mesh
from _models import Block, lm_loss, make, reference_step, tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpus():
    with fs.testing.Pool(torch.cuda.device_count(), backend="nccl", timeout=240) as pool:
        yield pool


def cuda_step(param_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    model = make(batchnorm=False).to(dev)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(world, device="cuda"))
    plan = fs.plan(model, fs.policy.by_type(Block), example_args=(tokens(rank).to(dev),))
    model.to("meta")
    results = {}
    for name, apply in {
        "schedule": fs.schedule(model, plan, param_dtype=param_dtype),
        "unshard": lambda p, b: fs.functional_call(
            model, fs.unshard(p, param_dtype=param_dtype), (b,)
        ),
    }.items():
        batch = tokens(rank).to(dev)
        _, grads = fs.value_and_grad(lambda p, b=batch, f=apply: lm_loss(f(p, b).float(), b))(
            sharded
        )
        torch.cuda.synchronize()
        results[name] = {k: g.full_tensor().cpu() for k, g in grads.items()}
    _, ref, _ = reference_step(make(batchnorm=False), [tokens(r) for r in range(world)])
    return {
        name: max((g[k] - ref[k]).abs().max().item() for k in ref) for name, g in results.items()
    }


@pytest.mark.parametrize(("param_dtype", "tol"), [(None, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_parity(gpus, param_dtype, tol):
    for errs in gpus.run(cuda_step, param_dtype):
        assert all(e < tol for e in errs.values()), errs


# ------------------------------------------------------------------ the optimizer on the device


def _clipped(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """clip_by_global_norm's arithmetic by hand (torch's clip_grad_norm_ takes the norm of the
    norms in another order, which can differ in the last bit)."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    total = torch.stack(torch._foreach_mul(norms, norms)).sum().sqrt()
    return torch._foreach_mul(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


@pytest.mark.parametrize("kind", ["fused", "capturable"])
@pytest.mark.parametrize("scheduled", [False, True])
def test_adamw_on_the_device_is_torch_bit_for_bit(kind, scheduled):
    """fs.optim.adamw(fused=True) / (capturable=True) with clipping and a warm-up cosine
    schedule is torch.optim.AdamW with the same options bit for bit over 60 steps (torch's lr a
    float32 device tensor set to the schedule's value at each step, as the counts on the device
    compute it)."""
    dev = torch.device("cuda")
    shapes = {"b": (32,), "e": (100, 16), "w": (64, 32)}  # sorted: the trees' order
    gen = torch.Generator(device=dev).manual_seed(0)
    params = {k: torch.randn(s, device=dev, generator=gen) for k, s in shapes.items()}
    schedule = fs.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 60)
    lr = schedule if scheduled else 3e-3
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(lr, weight_decay=0.1, **{kind: True})
    )
    ours = {k: v.clone() for k, v in params.items()}
    state = opt.init(ours)
    assert state[1].count.device.type == "cuda" and state[1].steps["w"].device.type == "cuda"
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    torch_lr = torch.tensor(0.0, device=dev) if scheduled else 3e-3
    topt = torch.optim.AdamW(ref, lr=torch_lr, weight_decay=0.1, **{kind: True})
    for i in range(60):
        grads = [torch.randn(s, device=dev, generator=gen) for s in shapes.values()]
        if scheduled:
            torch_lr.fill_(schedule(torch.tensor(i, device=dev)).float())
        for p, g in zip(ref, _clipped(grads, 0.5), strict=True):
            p.grad = g
        topt.step()
        ours, state = fs.optim.step(opt, ours, dict(zip(shapes, grads, strict=True)), state)
    for k, p in zip(shapes, ref, strict=True):
        assert torch.equal(ours[k], p.detach()), (k, (ours[k] - p).abs().max().item())
    assert int(state[1].count) == 60


def test_a_state_with_host_counts_moves_to_the_device():
    """A state made by adamw() (host counts: a checkpoint of one) continues under
    adamw(fused=True) on the GPU as torch.optim does: the fused AdamW loading the foreach
    AdamW's state_dict; bit for bit."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    params = {"w": torch.randn(32, 8, device=dev, generator=gen)}
    grads = [torch.randn(32, 8, device=dev, generator=gen) for _ in range(8)]
    host, fused = fs.optim.adamw(1e-2), fs.optim.adamw(1e-2, fused=True)
    ours = {"w": params["w"].clone()}
    state = host.init(ours)
    ref = [torch.nn.Parameter(params["w"].clone())]
    topt = torch.optim.AdamW(ref, lr=1e-2)
    for i, g in enumerate(grads):
        if i == 4:
            saved = topt.state_dict()
            topt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
            topt.load_state_dict(saved)  # which restores the saved group's fused=None too,
            topt.param_groups[0]["fused"] = True  # and keeps the host step, which fused refuses
            topt.state[ref[0]]["step"] = topt.state[ref[0]]["step"].to(dev)
        ref[0].grad = g.clone()
        topt.step()
        ours, state = fs.optim.step(host if i < 4 else fused, ours, {"w": g.clone()}, state)
    assert state.count.device.type == "cuda" and int(state.count) == 8
    assert torch.equal(ours["w"], ref[0].detach())


# ------------------------------------------------------------------ fs.cuda_graph


GRAPHED = {
    "default": {},
    "bf16, fused, 2 micro-batches": dict(param_dtype=torch.bfloat16, fused=True, micro=2),
    "no reshard, prefetch 2": dict(reshard_after_forward=False, prefetch=2),
    "HSDP": dict(mesh_shape=(1, 1)),
}


def graphed_vs_eager(kw):
    from _graphs import same, train

    eager = train("cuda", False, 50, **kw)
    again = train("cuda", False, 50, **kw)  # the eager step's own run-to-run differences
    graphed = train("cuda", True, 50, **kw)
    return same(eager, graphed), same(eager, again), graphed["graphs"]


@pytest.mark.parametrize("name", list(GRAPHED))
def test_cuda_graph_equals_eager_bit_for_bit(gpus, name):
    """The whole step (gathers, forward, backward, reduce-scatters, clipping, AdamW with a
    schedule) through fs.cuda_graph over 50 steps: the eager step's losses, parameters and
    optimizer state, bit for bit (NCCL) -- where the eager step repeats itself bit for bit
    (else within its own run-to-run differences)."""
    for diff, control, graphs in gpus.run(graphed_vs_eager, GRAPHED[name]):
        print(name, "graphed - eager:", diff, "eager - eager:", control)
        assert graphs == 1
        for key in diff:
            assert diff[key] <= 2 * control[key], (key, diff, control)


def graphed_compiled_vs_compiled(kw):
    from _graphs import same, train

    compiled = train("cuda", False, 20, compile_backend="inductor", **kw)
    again = train("cuda", False, 20, compile_backend="inductor", **kw)
    graphed = train("cuda", True, 20, compile_backend="inductor", **kw)
    return same(compiled, graphed), same(compiled, again), graphed["graphs"], graphed["frames"]


@pytest.mark.parametrize("name", ["default", "bf16, fused, 2 micro-batches"])
def test_a_compiled_step_captured_equals_it_compiled(gpus, name):
    """``fs.cuda_graph(torch.compile(step))`` (inductor; AdamW with its counts on the device:
    ``capturable=True``, or ``fused=True`` with bf16 and 2 micro-batches) over 20 steps: the
    compiled step's losses, parameters and state, within the compiled step's own run-to-run
    differences; compiled once, captured once."""
    for diff, control, graphs, frames in gpus.run(graphed_compiled_vs_compiled, GRAPHED[name]):
        print("graphed - compiled:", diff, "compiled - compiled:", control)
        assert (graphs, frames) == (1, 1)
        for key in diff:
            assert diff[key] <= 2 * control[key], (key, diff, control)


def graphed_jitted_vs_jitted(kw):
    from _graphs import same, train

    jitted = train("cuda", False, 20, jit_backend="inductor", **kw)
    again = train("cuda", False, 20, jit_backend="inductor", **kw)
    graphed = train("cuda", True, 20, jit_backend="inductor", **kw)
    eager = train("cuda", False, 20, **kw)
    losses = (jitted["losses"] - eager["losses"]).abs() / eager["losses"].abs()
    return (same(jitted, graphed), same(jitted, again), graphed["graphs"], graphed["frames"],
            losses.max().item())  # fmt: skip


@pytest.mark.parametrize("name", ["default", "bf16, fused, 2 micro-batches"])
def test_a_jitted_step_captured_equals_it_jitted(gpus, name):
    """``fs.cuda_graph(fs.jit(step))`` (inductor; AdamW with its counts on the device) over 20
    steps: the jitted step's losses, parameters and state, within the jitted step's own
    run-to-run differences; traced once, captured once; the jitted losses within 1e-3 of the
    eager step's (relative; bf16 moves them more than the compiled arithmetic does)."""
    for diff, control, graphs, traces, gap in gpus.run(graphed_jitted_vs_jitted, GRAPHED[name]):
        print("graphed - jitted:", diff, "jitted - jitted:", control, "jitted vs eager:", gap)
        assert (graphs, traces) == (1, 1)
        assert gap <= 1e-3
        for key in diff:
            assert diff[key] <= 2 * control[key], (key, diff, control)


def test_cuda_graph_at_8_fake_ranks_agrees_once():
    """8 ranks of a fake process group on the GPU: the step captures and replays, and the
    ranks' agreement through the store ran at the warm-up and capture calls only."""
    from benchmarks.fake import fake_world

    from _models import Block, lm_loss, make, tokens

    with fake_world(8, device="cuda") as mesh:
        model = make(batchnorm=False).cuda()
        params, _ = fs.extract(model)
        sharded = fs.shard(params, mesh)
        plan = fs.plan(model, fs.policy.by_type(Block), example_args=(tokens(0).cuda(),))
        model.to("meta")
        apply = fs.schedule(model, plan, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        opt = fs.optim.adamw(1e-3, fused=True)
        state = opt.init(sharded)
        vg = fs.value_and_grad(lambda p, b: lm_loss(apply(p, b).float(), b))

        def train_step(params, state, batch):
            loss, grads = vg(params, batch)
            params, state = fs.optim.step(opt, params, grads, state)
            return loss, params, state

        step = fs.cuda_graph(train_step)
        sets = []
        for i in range(8):
            _, sharded, state = step(sharded, state, tokens(0, step=i).cuda())
            sets.append(mesh.store.sets)
        torch.cuda.synchronize()
    assert step.graphs == 1
    assert sets[0] > 0 and sets[2] > sets[1] and sets[2:] == [sets[2]] * 6, sets


def _branches(w, x):
    loss = (w * x).sum()
    if loss > 0:
        w.add_(x)
    return loss, w


def _host_tensor(w, x):
    w.add_(torch.arange(3.0).to(w.device) * x)
    return w.sum(), w


@pytest.mark.parametrize(("step", "what"), [(_branches, "reads a device value on the host"),
                                             (_host_tensor, "uses a CPU tensor")])  # fmt: skip
def test_cuda_graph_refuses_what_it_cannot_capture(step, what):
    graphed = fs.cuda_graph(step, warmup=1)
    w = torch.zeros(3, device="cuda")
    graphed(w, torch.ones(3, device="cuda"))
    with pytest.raises(RuntimeError, match=rf"cannot be captured: .*{what}.*test_cuda\.py:\d+"):
        graphed(w, torch.ones(3, device="cuda"))
