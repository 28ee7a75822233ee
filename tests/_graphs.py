"""A funcshard training step run eagerly and through ``fs.cuda_graph``, for the graph tests
(run inside rank processes: ``tests/test_cuda_graph.py`` on CPU through the stand-in backend,
``tests/test_cuda.py`` on a GPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import funcshard as fs
from funcshard._execution._cuda_graph import CudaGraphed

from _mesh import mesh
from _models import Block, lm_loss, make, tokens


def train(
    device: str,
    graphed: bool,
    steps: int,
    *,
    backend=None,
    mesh_shape: tuple[int, ...] | None = None,
    param_dtype: torch.dtype | None = None,
    micro: int = 1,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    fused: bool = False,
    capturable: bool = True,
    clip: bool = True,
    compile_backend: str | None = None,
    jit_backend: str | None = None,
) -> dict:
    """``steps`` training steps of a tiny LM (AdamW with a warm-up schedule, clipping, ``micro``
    micro-batches per step); eager or graphed; with ``compile_backend``, the step is
    ``torch.compile``'d (``fullgraph=True``) first; with ``jit_backend``, it is ``fs.jit``'s
    (with that backend) first. Returns the losses, the final full
    parameters and optimizer state (on the CPU), the graphed callable's graph count and the
    frames compiled."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(batchnorm=False).to(device)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(*(mesh_shape or (world,)), device=device))
    plan = fs.plan(
        model,
        fs.policy.by_type(Block),
        example_args=(tokens(rank).to(device),),
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
    )
    model.to("meta")
    reduce_dtype = torch.float32 if param_dtype is not None else None
    apply = fs.schedule(model, plan, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # a warm-up from above 0: torch's capturable kernel divides by the learning rate (see
    # docs/optim.md)
    lr = fs.optim.linear_schedule(1e-3, 1e-2, 10)
    adamw = fs.optim.adamw(lr, weight_decay=0.1, fused=fused, capturable=capturable)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), adamw) if clip else adamw
    state = opt.init(sharded)
    vg = fs.value_and_grad(lambda p, b: lm_loss(apply(p, b).float(), b))

    def train_step(params, state, batch):
        total, grads = None, None
        for mb in batch.chunk(micro):
            loss, g = vg(params, mb)
            total = loss if total is None else total + loss
            grads = g if grads is None else fs.tree_map(torch.add, grads, g)
        if micro > 1:
            grads = fs.tree_map(lambda x: x / micro, grads)
        params, state = fs.optim.step(opt, params, grads, state)
        return total / micro, params, state

    step, counter = train_step, None
    if compile_backend is not None:
        counter = CompileCounterWithBackend(compile_backend)
        step = torch.compile(train_step, backend=counter, fullgraph=True)
    jitted = None
    if jit_backend is not None:
        step = jitted = fs.jit(train_step, backend=jit_backend)
    if graphed:
        step = (
            fs.cuda_graph(step)
            if backend is None
            else CudaGraphed(step, warmup=2, max_graphs=4, backend=backend)
        )
    losses = []
    for i in range(steps):
        batch = tokens(rank, batch=4, step=i).to(device)
        loss, sharded, state = step(sharded, state, batch)
        losses.append(loss.detach().float().cpu())
    full = {k: v.full_tensor().cpu() for k, v in sharded.items()}
    flat = [x for x in torch.utils._pytree.tree_leaves(state) if isinstance(x, torch.Tensor)]
    states = [(x.full_tensor() if hasattr(x, "full_tensor") else x).cpu() for x in flat]
    return {
        "losses": torch.stack(losses),
        "params": full,
        "state": states,
        "graphs": getattr(step, "graphs", 0),
        "frames": counter.frame_count if counter else (jitted.traces if jitted else 0),
    }


def same(a: dict, b: dict) -> dict:
    """Largest differences between two ``train`` results (0.0 everywhere: bit for bit)."""
    return {
        "losses": (a["losses"] - b["losses"]).abs().max().item(),
        "params": max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"]),
        "state": max(
            (x.double() - y.double()).abs().max().item()
            for x, y in zip(a["state"], b["state"], strict=True)
        ),
    }
