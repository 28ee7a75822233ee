"""Plans for forwards that cannot run on meta: recorded from one real forward over the shards
(``fs.plan(..., sharded=...)``, ``check_plan(..., sharded=...)``). The order is the module's
own, the step computes as the unsharded model, the recording leaves no trace, and ranks that
take different paths get one error on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

from _checks import raises
from _comm import counts
from _mesh import mesh
from _models import reference_step


class Gate(nn.Module):
    """Reads a value (``.item()``): runs ``a`` then ``b`` if the input's first element is
    positive, else ``b`` then ``a``; ``noisy`` adds dropout and a BatchNorm (train-mode state)."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.extra = nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(8)) if noisy else nn.Identity()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        first, second = (self.a, self.b) if x[0, 0].item() > 0 else (self.b, self.a)
        return self.out(self.extra(second(torch.tanh(first(h)))))


POLICY = fs.policy.by_names(["a", "b"])


def _x(sign: float, seed: int = 0) -> torch.Tensor:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    x[0, 0] = sign * x[0, 0].abs()
    return x


def _setup(noisy=False):
    torch.manual_seed(0)
    model = Gate(noisy)
    reference = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    return model, reference, sharded, buffers


def test_a_forward_that_reads_values_fails_on_meta_with_the_fix():
    with pytest.raises(RuntimeError, match=r"sharded=<the shards>.*order=") as e:
        fs.plan(Gate(), POLICY, example_args=(_x(1),))
    assert "item()" in str(e.value.__cause__)
    with pytest.raises(RuntimeError, match=r"check_plan: the dry run .* sharded="):
        fs.testing.check_plan(Gate(), fs.plan(Gate(), POLICY), _x(1))


def recorded_step():
    """The order of the real forward (each branch), check_plan, and a scheduled step whose loss
    and gradients are the unsharded model's (mean over the ranks' batches)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference, sharded, buffers = _setup()
    orders = {}
    for sign in (1, -1):
        plan = fs.plan(model, POLICY, example_args=(_x(sign),), sharded=sharded, buffers=buffers)
        orders[sign] = plan.order
        assert fs.testing.check_plan(model, plan, _x(sign), sharded=sharded, buffers=buffers).ok
        edited = fs.testing.check_plan(model, plan, _x(-sign), sharded=sharded, buffers=buffers)
        assert not edited.ok and edited.used == ("", *plan.order[1:3][::-1], ""), str(edited)
    plan = fs.plan(model, POLICY, example_args=(_x(1),), sharded=sharded, buffers=buffers)
    apply = fs.schedule(model, plan)
    batch = _x(1, seed=rank)
    loss_fn = lambda out, _: out.square().mean()
    loss, grads = fs.value_and_grad(lambda p: loss_fn(apply(p, batch, buffers=buffers), None))(
        sharded
    )
    ref_loss, ref_grads, _ = reference_step(
        reference, [_x(1, seed=r) for r in range(world)], loss_fn
    )
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss)
    fs.testing.assert_close(grads, ref_grads)
    return orders


def test_recorded_from_a_real_forward(world2):
    expected = {1: ("", "a", "b", ""), -1: ("", "b", "a", "")}
    assert world2.run(recorded_step) == [expected, expected]


def no_trace():
    """Recording draws no random numbers the training would see (dropout), updates no
    buffer (BatchNorm), and gathers each run's group once."""
    model, reference, sharded, buffers = _setup(noisy=True)
    before = {k: v.clone() for k, v in buffers.items()}
    state = torch.get_rng_state()
    with torch.distributed.tensor.debug.CommDebugMode() as comm:
        plan = fs.plan(model, POLICY, example_args=(_x(1),), sharded=sharded, buffers=buffers)
    assert torch.equal(torch.get_rng_state(), state)
    fs.testing.assert_close(buffers, before, rtol=0, atol=0)
    assert counts(comm) == {"all_gather": len(plan.order)}
    # the recorded forward computed what the model computes: without recording, the same draws
    torch.manual_seed(5)
    want = reference.train()(_x(1))
    torch.manual_seed(5)
    got = fs.functional_call(model, (fs.unshard(sharded), before), (_x(1),))
    torch.testing.assert_close(got, want)
    return plan.order


def test_recording_leaves_no_trace(world2):
    assert world2.run(no_trace) == [("", "a", "b", "")] * 2


def disagreeing(case: str):
    """Ranks whose forwards differ: one error on every rank, before a mismatched gather."""
    rank = dist.get_rank()
    model, _, sharded, buffers = _setup()
    x = _x(1 if rank == 0 else -1)
    if case == "ends sooner" and rank == 1:
        model.b.forward = lambda h: h  # rank 1 stops using parameters after "a"
        model.out.forward = lambda h: h.sum(-1, keepdim=True)
        x = _x(1)
    if case == "fails" and rank == 1:
        model.a.forward = lambda h: 1 / 0
        x = _x(1)
    record = lambda: fs.plan(model, POLICY, example_args=(x,), sharded=sharded, buffers=buffers)
    try:
        record()
    except ValueError as e:
        message = str(e)
    else:
        return "no error"
    # the ranks are still in step: a collective afterwards works
    total = torch.ones(())
    dist.all_reduce(total)
    return message if total.item() == dist.get_world_size() else "out of step"


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("branch", "at run 1 (rank 0: 'a'; rank 1: 'b'"),
        ("ends sooner", "at run 2 (rank 0: 'b'; rank 1: <end of forward>"),
        ("fails", "at run 1 (rank 0: 'a'; rank 1: <failed: ZeroDivisionError>"),
    ],
)
def test_ranks_that_record_different_orders_fail_on_every_rank(world2, case, needle):
    messages = world2.run(disagreeing, case)
    assert messages[0] == messages[1], messages
    assert needle in messages[0] and "different orders" in messages[0], messages[0]


def bad_arguments():
    model, _, sharded, _ = _setup()
    missing = {k: v for k, v in sharded.items() if k != "a.weight"}
    return [
        raises(lambda: fs.plan(model, POLICY, sharded=sharded), ValueError, "example_args"),
        raises(
            lambda: fs.plan(model, POLICY, example_args=(_x(1),), sharded=sharded, order=["", "a"]),
            ValueError,
            "no order=",
        ),
        raises(
            lambda: fs.plan(model, POLICY, example_args=(_x(1),), sharded=missing),
            ValueError,
            "['a.weight']",
        ),
        raises(  # something else where a shard is expected
            lambda: fs.plan(
                model, POLICY, example_args=(_x(1),), sharded={**sharded, "a.weight": F.relu}
            ),
            TypeError,
            "a.weight",
        ),
    ]


def test_bad_arguments(world2):
    assert world2.run(bad_arguments) == [[None] * 4] * 2


# ---- Hugging Face models: .item() in the mask code ---------------------------------------------


def _hf(kind: str):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        return model, type(model.transformer.h[0]), "transformer.h"
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return model, type(model.model.layers[0]), "model.layers"


def hf_recorded(kind: str):
    """GPT-2 (tied head) and Llama (rotary buffers) on meta with an attention mask: the dry run
    fails in the mask code, the real recording gives the order of the dry run without a mask,
    check_plan agrees, and a scheduled step equals the unsharded model on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, block, prefix = _hf(kind)
    reference = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    model.to("meta")
    policy = fs.policy.by_type(block)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0
    dry = raises(
        lambda: fs.plan(
            model, policy, example_args=(ids,), example_kwargs={"attention_mask": mask}
        ),
        RuntimeError,
        "sharded=",
    )
    unmasked = fs.plan(model, policy, example_args=(ids,))  # the meta dry run, where it can
    plan = fs.plan(
        model, policy, example_args=(ids,), example_kwargs={"attention_mask": mask},
        sharded=sharded, buffers=buffers,
    )  # fmt: skip
    assert plan == unmasked and plan.order == ("", f"{prefix}.0", f"{prefix}.1", "")
    check = fs.testing.check_plan(
        model, plan, ids, attention_mask=mask, sharded=sharded, buffers=buffers
    )
    apply = fs.schedule(model, plan)

    def loss_fn(logits, ids):
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

    loss, grads = fs.value_and_grad(
        lambda p: loss_fn(apply(p, ids, buffers=buffers, attention_mask=mask).logits, ids)
    )(sharded)
    full = {k: v.detach() for k, v in reference.named_parameters()}

    def ref_loss(p, ids, mask):
        out = fs.functional_call(reference, p, (ids,), {"attention_mask": mask})
        return loss_fn(out.logits, ids)

    want_loss, want_grads = fs.testing.reference_value_and_grad(ref_loss, full, ids, mask)
    torch.testing.assert_close(loss, want_loss)
    fs.testing.assert_close(grads, {k: want_grads[k] for k in grads})
    return dry, check.ok


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models(world2, kind):
    assert world2.run(hf_recorded, kind) == [(None, True)] * 2
