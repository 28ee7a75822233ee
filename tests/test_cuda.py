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
