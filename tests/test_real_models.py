"""Real models nobody on the project wrote, on 2 gloo ranks: Hugging Face ``transformers`` models
built from small configs (no download): GPT-2 (tied head) and Llama, each with and without
activation checkpointing (``torch.utils.checkpoint`` per layer); T5 (an encoder-decoder), Mixtral
(a mixture of experts: each layer's experts a group of their own, stored on an expert mesh),
BERT (a masked LM, its head tied to the embeddings) and ViT (image classification), each with and
without the plan's recompute; and a ResNet-18-shaped network with BatchNorm (``_models.ResNet``:
torchvision's wheels for our torch are CUDA builds).

Each goes through the documented pattern (``fs.extract``, ``module.to("meta")``, ``fs.shard``,
``fs.plan`` + ``fs.schedule``, ``fs.unshard`` + ``fs.functional_call``, ``fs.reduce``,
``fs.value_and_grad``) and is checked against independent references: the unsharded model on the
global batch (loss, every gradient, the buffers), FSDP2 (``fully_shard`` per block + root; also
in bf16 with float32 reductions, collectives counted), ``torch.optim.AdamW`` on the unsharded
model for a few ``fs.optim.adamw`` steps (also with the module's own stale weights left in
place), a plan recorded from real inputs (given as keywords, as a user passes a batch), and
``torch.func.grad`` over the DTensor tree.

[Note: the ResNet's reference]
BatchNorm in training mode normalises over each rank's own batch, so the gradient of the global
batch is not what data parallelism computes (docs/testing.md). The ResNet's unsharded reference
is therefore the mean over ranks of each rank's batch run on its own copy of the unsharded
model (what DDP computes), and its running statistics are compared with that copy's.
"""

from __future__ import annotations

import functools
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

import funcshard as fs

from _comm import Collectives
from _mesh import mesh
from _models import BasicBlock, ResNet

VOCAB, LENGTH, BATCH = 96, 8, 2  # per-rank batch: BATCH sequences of LENGTH tokens
MODELS = ["gpt2", "gpt2-ckpt", "llama", "llama-ckpt", "resnet"]
# more families, each also with "-recompute": the plan recomputes the blocks (see plan_of)
FAMILIES = ["t5", "mixtral", "bert", "vit"]
MASK_ID = VOCAB - 1  # BERT's [MASK] token


# ---- the models ---------------------------------------------------------------------------


def family(name: str) -> str:
    """The model of ``name`` without its variant: "t5-recompute" -> "t5"."""
    return name.split("-")[0]


def build(name: str) -> nn.Module:
    """The model ``name`` (of :data:`MODELS` or :data:`FAMILIES`, with or without
    "-recompute"), with the same weights on every call and rank. The transformers models are
    built from small configs, otherwise the library's defaults (``use_cache`` included), with
    dropout off: the sharded run and its references would draw different masks."""
    torch.manual_seed(0)
    if name == "resnet":
        return ResNet()
    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs: token ids out of vocab, etc.
    size = dict(vocab_size=VOCAB, max_position_embeddings=16, num_hidden_layers=2,
                num_attention_heads=2, hidden_size=32, intermediate_size=64)  # fmt: skip
    kind = family(name)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
    elif kind == "llama":
        config = transformers.LlamaConfig(**size, num_key_value_heads=1)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "t5":  # the head tied to the shared embeddings of encoder and decoder
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
        assert model.lm_head.weight is model.shared.weight
    elif kind == "mixtral":  # 4 experts, top 2, stacked [experts, ...] weights per layer
        config = transformers.MixtralConfig(
            **size | {"intermediate_size": 32}, num_key_value_heads=1,
            num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    elif kind == "bert":  # the decoder tied to the word embeddings (and its bias to the head's)
        config = transformers.BertConfig(
            **size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        model = transformers.BertForMaskedLM(config)
        decoder = model.cls.predictions.decoder
        assert decoder.weight is model.bert.embeddings.word_embeddings.weight
    else:
        config = transformers.ViTConfig(
            **size, image_size=8, patch_size=4, num_labels=10,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = transformers.ViTForImageClassification(config)
    if name.endswith("-ckpt"):
        # torch.utils.checkpoint(use_reentrant=False) per layer; gradient_checkpointing_enable()
        # is its deprecated name in transformers 5
        model.activation_checkpointing_enable()
    return model.train()


def block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The model's block classes: one group (one ``fully_shard``) per block, the rest in the
    root. The MoE's experts are a group of their own in each layer, as torchtitan shards them."""
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralExperts
    from transformers.models.t5.modeling_t5 import T5Block
    from transformers.models.vit.modeling_vit import ViTLayer

    if isinstance(model, ResNet):
        return (BasicBlock,)
    blocks = (GPT2Block, LlamaDecoderLayer, T5Block, BertLayer, ViTLayer, MixtralDecoderLayer)
    (block,) = {type(m) for m in model.modules()} & set(blocks)
    return (block, MixtralExperts) if block is MixtralDecoderLayer else (block,)


def is_expert(path: str) -> bool:
    """Whether ``path`` (a parameter's or a module's) is in a MoE layer's experts."""
    return ".experts." in path + "."


def expert_mesh():
    """The experts' own mesh: each rank stores whole experts (``Shard(0)`` of the stacked
    weights), gathered and reduced on this mesh's process group, not the data-parallel one."""
    return mesh(2, names=("ep",))


def experts_apart(path: str, t: torch.Tensor):
    """``fs.shard``'s placement: the experts on :func:`expert_mesh`, the rest on the
    data-parallel mesh."""
    return (expert_mesh(), Shard(0)) if is_expert(path) else None


def plan_of(name: str, model: nn.Module, **options) -> fs.Plan:
    """``fs.plan`` with a group per block (:func:`block_types`); with "-recompute", every block
    that holds no other recomputes its forward in backward: a MoE layer holds its experts'
    group, so the experts recompute (what ``fs.schedule`` tells a user who asks for the
    layer)."""
    policy = fs.policy.by_type(*block_types(model))
    blocks = [n for n, m in model.named_modules() if isinstance(m, block_types(model))]
    inner = [n for n in blocks if not any(b.startswith(n + ".") for b in blocks)]
    return fs.plan(model, policy, recompute=inner if name.endswith("-recompute") else None,
                   **options)  # fmt: skip


def batch(name: str, rank: int, step: int = 0) -> dict[str, torch.Tensor]:
    """This rank's batch, with the keys of the model's forward: images and classes, or what a
    tokenizer and a collator give the model: token ids, an attention mask with right padding,
    and labels, -100 where no loss is taken: the padding (causal LMs, T5's targets) or every
    token but the masked ones (BERT's masked LM, its input showing ``MASK_ID`` there).

    Every rank has the same number of samples (of labelled tokens), so the mean of the ranks'
    losses is the loss of the global batch (docs/testing.md)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if family(name) in ("resnet", "vit"):
        size = 32 if name == "resnet" else 8
        images = torch.randn(BATCH, 3, size, size, generator=g)
        return {"pixel_values": images, "labels": torch.randint(0, 10, (BATCH,), generator=g)}
    ids = torch.randint(0, VOCAB - 1, (BATCH, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0  # the last sequence is 2 tokens shorter
    labels = ids.masked_fill(mask == 0, -100)
    if family(name) == "t5":  # targets of half the length, the last one a token shorter
        labels = torch.randint(0, VOCAB, (BATCH, LENGTH // 2), generator=g)
        labels[-1, -1] = -100
    elif family(name) == "bert":  # every third token masked (none in the padding)
        masked = torch.arange(LENGTH) % 3 == 1
        labels = ids.masked_fill(~masked, -100)
        ids = ids.masked_fill(masked, MASK_ID)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def inputs(name: str, b: dict[str, torch.Tensor]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the model's forward for the batch ``b``."""
    return ((b["pixel_values"],), {}) if name == "resnet" else ((), b)


def loss_of(name: str, forward, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of ``forward`` (the model, or a function called like it) on the batch ``b``."""
    args, kwargs = inputs(name, b)
    out = forward(*args, **kwargs)
    return F.cross_entropy(out, b["labels"]) if name == "resnet" else out.loss


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

    Gradients of the global batch; for the ResNet, the mean over ranks of each rank's batch on
    its own copy (see [Note: the ResNet's reference]).
    """
    model = build(name)
    full = {k: v.full_tensor() for k, v in sharded.items()}
    if name != "resnet":
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
    fully_shard(model, mesh=mesh(2), **options)
    with Collectives() as comm:
        loss = loss_of(name, model, b)
        loss.backward()
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
    """Gradients of the unsharded ``model`` into ``.grad``: the global batch (the ResNet: this
    rank's batch, gradients averaged over ranks as DDP does; see [Note: the ResNet's
    reference]). Returns the loss of this rank's batch."""
    if name == "resnet":
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
        for k, t in sharded.items()
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
    assert placed_like(grads, sharded)
    fs.testing.assert_close((loss, grads, buffers), (ref_loss, ref_grads, ref_buffers))
    fs.testing.assert_close((loss, grads, buffers), (fsdp_loss, fsdp_grads, fsdp_buffers))


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
    several blocks read (T5's encoder output, read by every decoder block's cross-attention) is
    summed within each block, then over the blocks; funcshard adds the terms one at a time, as
    the unsharded model does. bf16 sums grouped differently round differently (an identity
    Function on that input changes the unsharded model's encoder gradients by as much): T5 is
    compared to bf16's precision, the others to float32's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    b = batch(name, dist.get_rank())
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
    bf16 = {"rtol": 1.6e-2, "atol": 2e-3} if family(name) == "t5" else {}
    fs.testing.assert_close((loss, grads, buffers), tuple(expected), **bf16)
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


def planned_order(model: nn.Module) -> tuple[str, ...]:
    """The groups' forward order, by hand: the root (embeddings, the stem), each block in turn
    (a MoE layer, then its experts), the root again (the final norm and the head, tied or
    not). An encoder-decoder's blocks are in two submodules of the root, and the root runs
    between them (the encoder's final norm, the decoder's embeddings)."""
    order = []
    for n, m in model.named_modules():
        if isinstance(m, block_types(model)):
            if not order or n.split(".")[0] != order[-1].split(".")[0]:
                order.append("")
            order.append(n)
    return (*order, "")


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
    fs.testing.assert_close((loss, grads, buffers), (ref_loss, ref_grads, ref_buffers))


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
    fs.testing.assert_close((loss, grads, buffers), (ref_loss, ref_grads, ref_buffers))


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


@pytest.mark.parametrize(
    ("name", "reshard"),
    [
        *[("gpt2", True), ("gpt2-ckpt", False), ("llama", False), ("llama-ckpt", True)],
        *[(name, False) for name in FAMILIES],
        *[(name, True) for name in RECOMPUTED],  # the recompute: backward's one re-gather
    ],
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
