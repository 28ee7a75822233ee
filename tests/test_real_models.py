"""Real models nobody on the project wrote, on 2 gloo ranks (``_hf``): Hugging Face
``transformers`` families built from small configs (no download) -- GPT-2 and Llama, each with
and without activation checkpointing (``torch.utils.checkpoint`` per layer); T5, Mixtral, BERT,
ViT, Qwen3, Gemma3, Phi3, Qwen3-MoE, DeepSeek-V3, Whisper, CLIP and Mamba, each with and without
the plan's recompute (the experts of the mixtures on an expert mesh) -- and a
ResNet-18-shaped network with BatchNorm.

Each goes through the documented pattern (``fs.extract``, ``module.to("meta")``, ``fs.shard``,
``fs.plan`` + ``fs.schedule``, ``fs.unshard`` + ``fs.functional_call``, ``fs.reduce``,
``fs.value_and_grad``) and is checked against independent references: the unsharded model on the
global batch (loss, every gradient, the buffers), FSDP2 (``fully_shard`` per block + root; also
in bf16 with float32 reductions, collectives counted), ``torch.optim.AdamW`` on the unsharded
model for a few ``fs.optim.adamw`` steps (also with the module's own stale weights left in
place), a plan recorded from real inputs (given as keywords, as a user passes a batch), and
``torch.func.grad`` over the DTensor tree. ``fs.explain`` of the mixtures in float32 is checked
against their real step's collectives.

[Note: losses over each rank's own batch]
BatchNorm in training mode normalises over each rank's own batch, and a contrastive loss
(CLIP's) scores each caption against the images of its own batch only: in both, a sample's loss
depends on the rest of the rank's batch, so the gradient of the global batch is not what data
parallelism computes (docs/testing.md; docs/failures.md for the contrastive loss over the global
batch). Their unsharded reference (:data:`_hf.OWN_BATCH`) is therefore the mean over ranks of
each rank's batch run on its own copy of the unsharded model (what DDP computes), and the
ResNet's running statistics are compared with that copy's.
"""

from __future__ import annotations

import functools
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

from _comm import Collectives
from _hf import (
    OWN_BATCH,
    batch,
    block_types,
    build,
    expert_mesh,
    experts_apart,
    family,
    inputs,
    is_expert,
    loss_of,
    plan_of,
    planned_order,
)
from _mesh import mesh

MODELS = ["gpt2", "gpt2-ckpt", "llama", "llama-ckpt", "resnet"]
# more families, each also with "-recompute": the plan recomputes the blocks (see plan_of)
FAMILIES = ["t5", "mixtral", "bert", "vit", "qwen3", "gemma3", "phi3", "qwen3moe", "deepseek"]
FAMILIES += ["whisper", "clip", "mamba"]


def functional(model: nn.Module, tensors):
    """``model`` called like itself, with ``tensors`` (``(params, buffers)``) instead of its own."""
    return lambda *args, **kwargs: fs.functional_call(model, tensors, args, kwargs)


# ---- references ---------------------------------------------------------------------------


def setup(name: str, on_meta: bool = True):
    """The documented pattern: ``(model, sharded, buffers, plan)``, the module on meta (or, with
    ``on_meta=False``, keeping its own weights, which funcshard must never read). The plan has
    the model's forward order: the default, depth first, does not know that T5's root runs
    between its encoder and decoder (each decoder block would be gathered on demand, twice
    with reshard after forward)."""
    model = build(name)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(2), experts_apart)
    plan = plan_of(name, model, order=planned_order(model))
    if on_meta:
        model.to("meta")
    return model, sharded, {k: v.clone() for k, v in buffers.items()}, plan


def reference(name: str, sharded, buffers, b):
    """The unsharded model on this step: ``(this rank's loss, full gradients, buffers after)``.

    Gradients of the global batch; for the ResNet and CLIP, the mean over ranks of each rank's
    batch on its own copy (see [Note: losses over each rank's own batch]).
    """
    model = build(name)
    full = {k: v.full_tensor() for k, v in sharded.items()}
    if family(name) not in OWN_BATCH:
        loss_fn = lambda p, b: loss_of(name, functional(model, (p, buffers)), b)
        value, grads = fs.testing.reference_value_and_grad(loss_fn, full, b)
        return value, grads, buffers
    own = {k: v.clone() for k, v in buffers.items()}
    full = {k: v.requires_grad_() for k, v in full.items()}
    value = loss_of(name, functional(model, (full, own)), b)
    grads = dict(zip(full, torch.autograd.grad(value, list(full.values())), strict=True))
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return value.detach(), grads, own


def fsdp2(name: str, b, **options):
    """FSDP2, ``fully_shard(**options)`` per block and on the root (the experts on their
    own mesh): ``(loss, {fqn: sharded grad}, buffers, {collective: count})``."""
    from torch.distributed.fsdp import fully_shard

    model = build(name)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, block_types(model))]
    # innermost first (experts before their layer); fully_shard changes a module's class
    for fqn, block in reversed(blocks):
        fully_shard(block, mesh=expert_mesh() if is_expert(fqn) else mesh(2), **options)
    # FSDP2 refuses 0-d parameters (CLIP's logit_scale): left out, all-reduced by hand
    scalars = {p for p in model.parameters() if p.dim() == 0}
    fully_shard(model, mesh=mesh(2), ignored_params=scalars, **options)
    with Collectives() as comm:
        loss = loss_of(name, model, b)
        loss.backward()
    for p in scalars:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return loss.detach(), grads, dict(model.named_buffers()), comm.counts()


def global_batch(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's batch concatenated along dim 0, in rank order."""
    out = {}
    for k, x in b.items():
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, x)
        out[k] = torch.cat(pieces)
    return out


def reference_step(name: str, model: nn.Module, b) -> torch.Tensor:
    """Gradients of the unsharded ``model`` into ``.grad``: the global batch (the ResNet and
    CLIP: this rank's batch, gradients averaged over ranks as DDP does; see [Note: losses over
    each rank's own batch]). Returns the loss of this rank's batch."""
    if family(name) in OWN_BATCH:
        loss = loss_of(name, model, b)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        return loss.detach()
    loss_of(name, model, global_batch(b)).backward()
    with torch.no_grad():
        return loss_of(name, model, b)


def without_key_bias(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters without the attention's key bias: the key part of GPT-2's
    ``c_attn.bias``, BERT's ``key.bias``, ViT's ``k_proj.bias`` (see [Note: Adam's
    parameters])."""
    out = {k: v for k, v in params.items() if not k.endswith((".key.bias", ".k_proj.bias"))}
    for k, v in params.items():
        if k.endswith("attn.c_attn.bias"):
            query, _, value = v.chunk(3)
            out[k] = torch.cat([query, value])
    return out


# ---- the checks ---------------------------------------------------------------------------


def sharded_loss(name: str, path: str, model, plan, buffers):
    """``loss(sharded, batch)`` through ``path``: "schedule", or "unshard" + functional_call."""
    if path == "schedule":
        apply = fs.schedule(model, plan)
        return lambda p, b: loss_of(name, functools.partial(apply, p, buffers=buffers), b)
    return lambda p, b: loss_of(name, functional(model, (fs.unshard(p), buffers)), b)


def placed_like(grads, sharded) -> bool:
    """Whether every gradient has its shard's mesh (the experts': the expert mesh) and
    placements."""
    return all(
        (grads[k].device_mesh, grads[k].placements) == (t.device_mesh, t.placements)
        for k, t in trainable(sharded, sharded).items()
    )


def trainable(tree: dict, sharded: dict) -> dict:
    """``tree`` without the frozen parameters (Whisper's sinusoidal positions), whose gradient
    is ``None`` in funcshard and FSDP2 and zeros in the references that differentiate every
    floating-point tensor."""
    return {k: v for k, v in tree.items() if sharded[k].requires_grad}


def assert_matches(sharded, ours: tuple, expected: tuple, **tolerance) -> None:
    """``fs.testing.assert_close`` of ``(loss, grads, buffers)`` and ``expected``, the frozen
    parameters' gradients left out of both (see :func:`trainable`)."""
    (loss, grads, buffers), (their_loss, their_grads, their_buffers) = ours, expected
    fs.testing.assert_close(
        (loss, trainable(grads, sharded), buffers),
        (their_loss, trainable(their_grads, sharded), their_buffers),
        **tolerance,
    )


def frozen_get_none(grads, sharded) -> bool:
    """Whether the frozen parameters, and they alone, got ``None``."""
    return {k for k, g in grads.items() if g is None} == set(sharded) - set(
        trainable(sharded, sharded)
    )


def gradients_match(name: str, path: str) -> None:
    """One step through ``path`` == the unsharded model == FSDP2: the loss, every gradient (and
    its placements), the buffers. "reduce": full gradients by plain autograd, then fs.reduce."""
    model, sharded, buffers, plan = setup(name)
    b = batch(name, dist.get_rank())
    ref_loss, ref_grads, ref_buffers = reference(name, sharded, buffers, b)
    fsdp_loss, fsdp_grads, fsdp_buffers, _ = fsdp2(name, b)
    if path == "reduce":
        full = {k: v.detach().requires_grad_() for k, v in fs.unshard(sharded).items()}
        loss = loss_of(name, functional(model, (full, buffers)), b)
        grads = torch.autograd.grad(loss, list(full.values()))
        grads = fs.reduce(dict(zip(full, grads, strict=True)), sharded)
    else:
        loss, grads = fs.value_and_grad(sharded_loss(name, path, model, plan, buffers))(sharded, b)
    assert placed_like(grads, sharded) and frozen_get_none(grads, sharded)
    assert_matches(sharded, (loss, grads, buffers), (ref_loss, ref_grads, ref_buffers))
    assert_matches(sharded, (loss, grads, buffers), (fsdp_loss, fsdp_grads, fsdp_buffers))


def bf16_matches_fsdp2(name: str, reshard: bool) -> None:
    """bf16 parameters with float32 reductions, through the schedule, == FSDP2 with the same
    ``MixedPrecisionPolicy`` and ``reshard_after_forward``: the loss and every gradient; and the
    collectives of docs/schedule.md, checkpointing or not (the recompute re-gathers nothing):
    per group one reduce-scatter and one all-gather, two with reshard after forward but for the
    root, which stays unsharded; none of any kind more than FSDP2.

    [Note: bf16 against FSDP2]
    FSDP2 is asked not to cast each block's floating inputs to bf16: funcshard leaves them as
    they come (docs/fsdp2.md), and Mixtral's routing weights reach its experts in float32.
    FSDP2 passes each block's inputs through an autograd Function, so the gradient of an input
    several blocks read (an encoder-decoder's encoder output, read by every decoder block's
    cross-attention) is summed within each block, then over the blocks; funcshard adds the
    terms one at a time, as the unsharded model does. bf16 sums grouped differently round
    differently (an identity Function on that input changes the unsharded model's encoder
    gradients by as much): T5 and Whisper are compared to bf16's precision, the others to
    float32's. Float inputs come in bf16, as a user casts them (Whisper's audio features meet a
    convolution first)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    b = {
        k: v.bfloat16() if v.is_floating_point() else v
        for k, v in batch(name, dist.get_rank()).items()
    }
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=False)
    *expected, theirs = fsdp2(name, b, mp_policy=mp, reshard_after_forward=reshard)
    model, sharded, buffers, _ = setup(name)
    plan = plan_of(
        name,
        model,
        order=planned_order(model),
        reshard_after_forward=reshard,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    with Collectives() as comm:
        loss, grads = fs.value_and_grad(sharded_loss(name, "schedule", model, plan, buffers))(
            sharded, b
        )
    bf16 = {"rtol": 1.6e-2, "atol": 2e-3} if family(name) in ("t5", "whisper") else {}
    assert_matches(sharded, (loss, grads, buffers), tuple(expected), **bf16)
    groups = len(plan.groups)  # the root and the blocks
    gathers = 2 * groups - 1 if reshard else groups
    ours = comm.counts()
    assert ours == {"all_gather": gathers, "reduce_scatter": groups}, ours
    assert all(n <= theirs.get(kind, 0) for kind, n in ours.items()), (ours, theirs)


LR = 1e-2


def adamw_matches(name: str, path: str, on_meta: bool, steps: int = 3) -> None:
    """``steps`` AdamW steps of ``fs.optim`` on the shards == ``torch.optim.AdamW`` on the
    unsharded model: the loss of every step, then every parameter and buffer.

    [Note: Adam's parameters]
    Adam divides each gradient element by its own root mean square, so a rounding difference
    in a gradient element near 0 moves the weight by up to ``LR`` times its *relative* size:
    the parameters are compared to ``LR / 100`` (a wrong gradient, as a stale weight gives,
    moves them by about ``LR``), the losses at every step to float32 precision. The key bias
    (GPT-2's, BERT's, ViT's) is left out: it adds ``q . b_k`` to every score of a query, which
    softmax ignores, so its exact gradient is 0 and its computed one pure noise, which Adam
    turns into steps of ``LR`` in either direction; the losses, which it cannot change, stand
    for it.

    ``on_meta=False``: the module keeps its own weights, which differ from the shards after the
    first step; a result that read them would be wrong from the second step on."""
    model, sharded, buffers, plan = setup(name, on_meta)
    loss_fn = sharded_loss(name, path, model, plan, buffers)
    opt = fs.optim.adamw(LR, weight_decay=0.1)
    state = opt.init(sharded)
    ref = build(name)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for step in range(steps):
        b = batch(name, dist.get_rank(), step)
        loss, grads = fs.value_and_grad(loss_fn)(sharded, b)
        sharded, state = fs.optim.step(opt, sharded, grads, state)
        fs.testing.assert_close(loss, reference_step(name, ref, b))
        ref_opt.step()
        ref_opt.zero_grad()
    ours = {k: v.full_tensor() for k, v in sharded.items()}
    theirs = {k: p.detach() for k, p in ref.named_parameters()}
    fs.testing.assert_close(without_key_bias(ours), without_key_bias(theirs), atol=LR / 100, rtol=0)
    fs.testing.assert_close(buffers, dict(ref.named_buffers()))


def recorded_plan_matches(name: str, real: bool) -> None:
    """A plan recorded from this rank's batch, the module on meta: by a dry run on meta copies
    of the inputs, or (``real``) by one real forward over the shards, as FSDP2 learns the order
    at run time (transformers' mask code calls ``.item()``, which meta tensors refuse). The
    recorded order is the model's own; ``check_plan`` finds nothing to report; a step run with
    the plan gathers nothing out of order (which warns) and equals the unsharded model (the
    recording left the buffers as they were)."""
    model, sharded, buffers, _ = setup(name)
    b = batch(name, dist.get_rank())
    args, kwargs = inputs(name, b)
    real_forward = {"sharded": sharded, "buffers": buffers} if real else {}
    examples = {"example_args": args} if args else {}  # keywords alone, as a user writes them
    plan = plan_of(name, model, **examples, example_kwargs=kwargs, **real_forward)
    assert plan.order == planned_order(model), plan
    check = fs.testing.check_plan(model, plan, *args, **real_forward, **kwargs)
    assert check.ok, check
    ref_loss, ref_grads, ref_buffers = reference(name, sharded, buffers, b)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*out of the planned forward order", UserWarning)
        loss, grads = fs.value_and_grad(sharded_loss(name, "schedule", model, plan, buffers))(
            sharded, b
        )
    assert_matches(sharded, (loss, grads, buffers), (ref_loss, ref_grads, ref_buffers))


def func_grad_matches(name: str) -> None:
    """``torch.func.grad_and_value`` straight over the DTensor tree, through the schedule (the
    module on meta): DTensor gradients placed like the shards, equal to the unsharded model's."""
    model, sharded, buffers, plan = setup(name)
    b = batch(name, dist.get_rank())
    ref_loss, ref_grads, ref_buffers = reference(name, sharded, buffers, b)
    apply = fs.schedule(model, plan)

    def loss_fn(p, bufs):  # buffers as an argument: BatchNorm updates them in place
        return loss_of(name, functools.partial(apply, p, buffers=bufs), b)

    grads, loss = torch.func.grad_and_value(loss_fn)(sharded, buffers)
    assert placed_like(grads, sharded)
    assert_matches(sharded, (loss, grads, buffers), (ref_loss, ref_grads, ref_buffers))


def explained_like_the_step(name: str) -> None:
    """``fs.explain`` of a float32 step with AdamW (the experts' grouped matmuls, whose fake
    kernel takes only bf16: see [Note: grouped matmuls on fake tensors]) against the real
    step, as ``tests/test_explain.py`` compares them: the collectives (kind, bytes in and out,
    count; torch.profiler's record of the real step) are equal, and the peak is within 10% of
    the allocator's (these models hold half a megabyte, where the prediction misses 3-9% in
    small allocations, dense models too)."""
    from benchmarks import explain_accuracy as ea
    from funcshard._runtime._profiling import peak_bytes

    model, sharded, buffers, plan = setup(name)
    apply = fs.schedule(model, plan)
    ids = batch(name, dist.get_rank())["input_ids"]

    def next_token(out, ids):
        return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    opt = fs.optim.adamw(LR)
    s = ea.Setup(apply, sharded, buffers, (ids,), opt, opt.init(sharded), next_token)
    rates = fs.Hardware({torch.float32: 1e10}, 1e10, 1e-6, 1e9, 1e-5)  # time is not tested
    e = fs.explain(apply, sharded, ids, optimizer=opt, buffers=buffers, loss=next_token,
                   hardware=rates)  # fmt: skip
    for _ in range(2):  # warm-up (see tests/test_explain.py)
        s.step()
    measured = min(peak_bytes(s.step, this_thread=True)[0] for _ in range(3))
    measured += ea.resident_bytes(s)
    assert ea.predicted_collectives(e) == ea.profiled_collectives(s)
    assert abs(e.peak_bytes - measured) <= 0.1 * measured, (e.peak_bytes, measured)


# ---- the tests ----------------------------------------------------------------------------


def on_ranks(pool, check, *args) -> None:
    """Run ``check(*args)`` on the pool's ranks; raise here what it raised there.

    [Note: failures returned, not raised]
    A rank that raises makes the pool stop its ranks and start new ones for the next test,
    which re-imports transformers (10-15 s on a loaded 2-core machine, for every failing test
    after it). The ranks return their tracebacks instead and stay up. Every check here
    fails on both ranks at the same point (a deterministic error, or a collective
    ``assert_close``), so no rank is left inside a collective.
    """
    errors = {r: e for r, e in enumerate(pool.run(_returning_errors, check, *args)) if e}
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in errors.items()))


def _returning_errors(check, *args) -> str | None:
    try:
        check(*args)
    except Exception:
        return traceback.format_exc()
    return None


RECOMPUTED = [f"{name}-recompute" for name in FAMILIES]


@pytest.mark.parametrize(
    ("name", "path"),
    [
        *[(name, path) for name in MODELS for path in ("schedule", "unshard", "reduce")],
        *[(name, "schedule") for name in FAMILIES + RECOMPUTED],  # (the other paths: above)
    ],
)
def test_gradients(world2, name, path):
    on_ranks(world2, gradients_match, name, path)


# Not CLIP: FSDP2 refuses its 0-d logit_scale, and left out of fully_shard it stays float32
@pytest.mark.parametrize(
    ("name", "reshard"),
    [
        *[("gpt2", True), ("gpt2-ckpt", False), ("llama", False), ("llama-ckpt", True)],
        *[(name, False) for name in FAMILIES if name != "clip"],
        *[(name, True) for name in RECOMPUTED if name != "clip-recompute"],  # backward's one
    ],  # re-gather
)
def test_bf16_matches_fsdp2(world2, name, reshard):
    on_ranks(world2, bf16_matches_fsdp2, name, reshard)


@pytest.mark.parametrize(
    ("name", "path", "on_meta"),
    [
        *[(name, "schedule", True) for name in ("gpt2", "llama", "resnet", *FAMILIES)],
        *[
            (name, path, on_meta)
            for name in ("gpt2-ckpt", "llama-ckpt")
            for path, on_meta in (("schedule", True), ("schedule", False), ("unshard", False))
        ],
        *[(name, "schedule", False) for name in RECOMPUTED],  # a recompute reading stale weights
    ],
)
def test_adamw_steps(world2, name, path, on_meta):
    on_ranks(world2, adamw_matches, name, path, on_meta)


@pytest.mark.parametrize(
    ("name", "real"),
    [
        ("resnet", False),
        *[(name, True) for name in MODELS + FAMILIES + RECOMPUTED],
    ],
)
def test_recorded_plan(world2, name, real):
    on_ranks(world2, recorded_plan_matches, name, real)


# Not the checkpointed models: transformers' activation checkpointing makes the embeddings'
# output require grad with requires_grad_(), which torch.func transforms refuse, unsharded too
# (and torch.utils.checkpoint's saved-tensor hooks are refused there: pytorch #122729). The
# plan's recompute works there.
@pytest.mark.parametrize(
    "name", [m for m in MODELS if not m.endswith("-ckpt")] + FAMILIES + RECOMPUTED
)
def test_func_grad(world2, name):
    on_ranks(world2, func_grad_matches, name)


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek"])  # (Mixtral's experts: the same)
def test_explain_in_float32(world2, name):
    on_ranks(world2, explained_like_the_step, name)


# ---- QLoRA: a Llama fine-tuned over NF4 weights -------------------------------------------


def qlora_llama():
    from _lowp import qlora

    return qlora(build("llama"))


def qlora_fine_tune(steps: int = 3) -> None:
    """QLoRA of a Hugging Face Llama: its decoder's linears NF4 (torchao) with LoRA adapters,
    everything else frozen; ``steps`` of ``fs.optim.adamw`` on the adapters == the unsharded
    model with ``torch.optim.AdamW`` (every loss, the adapters at the end); the first step's
    gradients == FSDP2's (``fully_shard`` per layer + root), bit for bit, with the same bytes
    gathered."""
    from _lowp import gathered_bytes

    model = qlora_llama()
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(2))
    assert (
        type(sharded["model.layers.0.self_attn.q_proj.weight"].to_local()).__name__ == "NF4Tensor"
    )
    trained = {k: v for k, v in sharded.items() if v.requires_grad}
    frozen = {k: v for k, v in sharded.items() if not v.requires_grad}
    apply = fs.schedule(model, plan_of("llama", model, order=planned_order(model)))
    forward = lambda p: functools.partial(apply, {**frozen, **p}, buffers=buffers)
    loss_fn = lambda p, b: loss_of("llama", forward(p), b)
    opt = fs.optim.adamw(LR, weight_decay=0.1)
    state = opt.init(trained)
    ref = qlora_llama()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                                weight_decay=0.1)  # fmt: skip
    theirs = qlora_llama()
    from torch.distributed.fsdp import fully_shard

    for layer in theirs.model.layers:
        fully_shard(layer, mesh=mesh(2))
    fully_shard(theirs, mesh=mesh(2))
    for step in range(steps):
        b = batch("llama", dist.get_rank(), step)
        with Collectives() as ours:
            loss, grads = fs.value_and_grad(loss_fn)(trained, b)
        if step == 0:
            with Collectives() as c:
                loss_of("llama", theirs, b).backward()
            their_grads = {k: p.grad for k, p in theirs.named_parameters() if p.requires_grad}
            fs.testing.assert_close(grads, their_grads, atol=0, rtol=0)
            assert gathered_bytes(ours, 2) == gathered_bytes(c, 2), (ours.sent, c.sent)
        trained, state = fs.optim.step(opt, trained, grads, state)
        fs.testing.assert_close(loss, reference_step("llama", ref, b))
        ref_opt.step()
        ref_opt.zero_grad()
    ours = {k: v.full_tensor() for k, v in trained.items()}
    fs.testing.assert_close(ours, {k: p.detach() for k, p in ref.named_parameters()
                                   if p.requires_grad}, atol=LR / 100, rtol=0)  # fmt: skip


def test_qlora_fine_tune_of_llama(world2):
    pytest.importorskip("torchao")
    on_ranks(world2, qlora_fine_tune)
