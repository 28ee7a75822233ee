"""Real models nobody on the project wrote, for the tests: Hugging Face ``transformers`` families
built from small configs (no download), and a ResNet-18-shaped network with BatchNorm
(``_models.ResNet``: torchvision does not import here). Each model ``name`` is a family, with an
optional variant after a dash: "llama", "llama-ckpt" (``torch.utils.checkpoint`` per layer),
"t5-recompute" (the plan recomputes the blocks: see :func:`plan_of`).

The families, and what each brings:

- decoders: GPT-2 (tied head), Llama, Qwen3 (norms on the queries and keys), Gemma3 (sliding and
  full attention layers, a scaled embedding as a buffer, tied head), Phi3 (fused projections);
- mixtures of experts, each layer's experts a group of their own, stored on an expert mesh:
  Mixtral, Qwen3-MoE, DeepSeek-V3 (a dense first layer, shared experts, a routing bias
  buffer, latent attention); their experts are grouped matmuls (``aten._grouped_mm``);
- encoder-decoders, whose root runs between their two stacks: T5 (the head tied to the shared
  embeddings), Whisper (audio features in, text out; the encoder layers take no cache);
- encoders: BERT (a masked LM, its decoder tied to the word embeddings), ViT (image
  classification), CLIP (a vision and a text tower, a contrastive loss over the batch);
- Mamba (a state-space model: convolutions and a selective scan, no attention);
- the ResNet.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

import funcshard as fs

from _mesh import mesh
from _models import BasicBlock, ResNet

VOCAB, LENGTH, BATCH = 96, 8, 2  # per-rank batch: BATCH sequences of LENGTH tokens
MASK_ID = VOCAB - 1  # BERT's [MASK] token
EOS_ID = VOCAB - 1  # CLIP's end of text, where its text tower pools
CAUSAL = ("gpt2", "llama", "qwen3", "gemma3", "phi3", "mixtral", "qwen3moe", "deepseek", "mamba")
# the ResNet (BatchNorm) and CLIP (a contrastive loss): a sample's loss depends on the other
# samples of its batch (see [Note: losses over each rank's own batch] in test_real_models)
OWN_BATCH = ("resnet", "clip")


def family(name: str) -> str:
    """The model of ``name`` without its variant: "t5-recompute" -> "t5"."""
    return name.split("-")[0]


def build(name: str) -> nn.Module:
    """The model ``name``, with the same weights on every call and rank: built from a small
    config, otherwise the library's defaults (``use_cache`` included), with dropout off (the
    sharded run and its references would draw different masks)."""
    torch.manual_seed(0)
    if name == "resnet":
        return ResNet()
    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs: token ids out of vocab, etc.
    model = _BUILDERS[family(name)](transformers)
    if name.endswith("-ckpt"):
        # torch.utils.checkpoint(use_reentrant=False) per layer; gradient_checkpointing_enable()
        # is its deprecated name in transformers 5
        model.activation_checkpointing_enable()
    return model.train()


_SIZE = dict(
    vocab_size=VOCAB, max_position_embeddings=16, num_hidden_layers=2, num_attention_heads=2,
    hidden_size=32, intermediate_size=64,
)  # fmt: skip
_MOE = dict(_SIZE, num_key_value_heads=1, num_experts_per_tok=2)  # 4 experts, top 2
_MAMBA = dict(
    vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2
)


def _gpt2(t):
    config = t.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = t.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def _t5(t):  # the head tied to the shared embeddings of encoder and decoder
    config = t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = t.T5ForConditionalGeneration(config)
    assert model.lm_head.weight is model.shared.weight
    return model


def _bert(t):  # the decoder tied to the word embeddings (and its bias to the head's)
    config = t.BertConfig(**_SIZE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = t.BertForMaskedLM(config)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    return model


def _vit(t):
    config = t.ViTConfig(
        **_SIZE, image_size=8, patch_size=4, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return t.ViTForImageClassification(config)


def _gemma3(t):  # a sliding-window layer, then a full one
    config = t.Gemma3TextConfig(
        **_SIZE, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = t.Gemma3ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _deepseek(t):  # layer 0 dense, layer 1 a mixture with a shared expert
    config = t.DeepseekV3Config(
        **_MOE | {"num_key_value_heads": 2}, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16,
    )  # fmt: skip
    return t.DeepseekV3ForCausalLM(config)


def _whisper(t):  # 8 mel bins, 16 frames (the encoder's 8 positions, after its stride 2)
    config = t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0,
        pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return t.WhisperForConditionalGeneration(config)


def _clip(t):
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(tower, vocab_size=VOCAB, max_position_embeddings=16, eos_token_id=EOS_ID)
    vision = dict(tower, image_size=8, patch_size=4)
    return t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


_BUILDERS = {
    "gpt2": _gpt2,
    "llama": lambda t: t.LlamaForCausalLM(t.LlamaConfig(**_SIZE, num_key_value_heads=1)),
    "t5": _t5,
    "mixtral": lambda t: t.MixtralForCausalLM(
        t.MixtralConfig(**_MOE | {"intermediate_size": 32}, num_local_experts=4)
    ),
    "bert": _bert,
    "vit": _vit,
    "qwen3": lambda t: t.Qwen3ForCausalLM(
        t.Qwen3Config(**_SIZE, num_key_value_heads=1, head_dim=16)
    ),
    "gemma3": _gemma3,
    "phi3": lambda t: t.Phi3ForCausalLM(  # its default pad token is beyond the vocabulary
        t.Phi3Config(**_SIZE, num_key_value_heads=1, resid_pdrop=0.0, pad_token_id=0)
    ),
    "qwen3moe": lambda t: t.Qwen3MoeForCausalLM(
        t.Qwen3MoeConfig(**_MOE, head_dim=16, moe_intermediate_size=32, num_experts=4)
    ),
    "deepseek": _deepseek,
    "whisper": _whisper,
    "clip": _clip,
    "mamba": lambda t: t.MambaForCausalLM(t.MambaConfig(**_MAMBA)),
}


# ---- how they are sharded and planned -------------------------------------------------------

_BLOCKS = {  # family: (module, classes): one group per block, the experts one of their own
    "gpt2": ("gpt2", "GPT2Block"),
    "llama": ("llama", "LlamaDecoderLayer"),
    "t5": ("t5", "T5Block"),
    "mixtral": ("mixtral", "MixtralDecoderLayer", "MixtralExperts"),
    "bert": ("bert", "BertLayer"),
    "vit": ("vit", "ViTLayer"),
    "qwen3": ("qwen3", "Qwen3DecoderLayer"),
    "gemma3": ("gemma3", "Gemma3DecoderLayer"),
    "phi3": ("phi3", "Phi3DecoderLayer"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeExperts"),
    "deepseek": ("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3Experts"),
    "whisper": ("whisper", "WhisperEncoderLayer", "WhisperDecoderLayer"),
    "clip": ("clip", "CLIPEncoderLayer"),
    "mamba": ("mamba", "MambaBlock"),
}


def block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The model's block classes: one group (one ``fully_shard``) per block, the rest in the
    root. A MoE's experts are a group of their own in each layer, as torchtitan shards them."""
    import importlib

    if isinstance(model, ResNet):
        return (BasicBlock,)
    name = type(model).__module__.split(".")[-1].removeprefix("modeling_")
    kind = next(k for k, (module, *_) in _BLOCKS.items() if module == name)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return tuple(getattr(module, c) for c in _BLOCKS[kind][1:])


def is_expert(path: str) -> bool:
    """Whether ``path`` (a parameter's or a module's) is in a MoE layer's routed experts."""
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


def planned_order(model: nn.Module) -> tuple[str, ...]:
    """The groups' forward order, by hand: the root (embeddings, the stem), each block in turn
    (a MoE layer, then its experts, then the layer again where it has shared experts, which
    DeepSeek-V3 runs after the routed ones), the root again (the final norm and the head, tied
    or not). Where the root has parameters between two blocks (in module order), it runs
    between them: an encoder-decoder's final encoder norm and decoder embeddings, CLIP's
    between its towers (CLIP runs its vision tower first, registered second)."""
    blocks = block_types(model)
    stacks: list[list[str]] = [[]]
    outer = None
    for n, m in model.named_modules():
        if outer is not None and n.startswith(outer + "."):
            if isinstance(m, blocks):  # a MoE layer's experts
                shared = hasattr(model.get_submodule(n.rsplit(".", 1)[0]), "shared_experts")
                stacks[-1] += [n, outer] if shared else [n]
            continue
        if isinstance(m, blocks):
            outer = n
            stacks[-1].append(n)
        elif stacks[-1] and next(m.parameters(recurse=False), None) is not None:
            stacks.append([])  # the root runs here
    stacks = [stack for stack in stacks if stack]
    if type(model).__name__ == "CLIPModel":
        stacks.reverse()
    return (*(g for stack in stacks for g in ("", *stack)), "")


# ---- their batches ---------------------------------------------------------------------------


def batch(name: str, rank: int, step: int = 0) -> dict[str, torch.Tensor]:
    """This rank's batch, with the keys of the model's forward: images and classes, audio
    features, or what a tokenizer and a collator give the model: token ids, an attention mask
    with right padding, and labels, -100 where no loss is taken: the padding (causal LMs,
    T5's and Whisper's targets) or every token but the masked ones (BERT's masked LM, its
    input showing ``MASK_ID`` there). CLIP gets images and captions ending in ``EOS_ID``.

    Every rank has the same number of samples (of labelled tokens), so the mean of the ranks'
    losses is the loss of the global batch (docs/testing.md; CLIP's is not: see
    :data:`OWN_BATCH`)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    kind = family(name)
    if kind in ("resnet", "vit"):
        size = 32 if name == "resnet" else 8
        images = torch.randn(BATCH, 3, size, size, generator=g)
        return {"pixel_values": images, "labels": torch.randint(0, 10, (BATCH,), generator=g)}
    ids = torch.randint(0, VOCAB - 1, (BATCH, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0  # the last sequence is 2 tokens shorter
    if kind in ("t5", "whisper"):  # targets of half the length, the last one a token shorter
        labels = torch.randint(2, VOCAB, (BATCH, LENGTH // 2), generator=g)
        labels[-1, -1] = -100
        if kind == "whisper":
            return {"input_features": torch.randn(BATCH, 8, 16, generator=g), "labels": labels}
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "clip":
        ids[:, -1], ids[-1, -3] = EOS_ID, EOS_ID  # each caption ends where its mask does
        images = torch.randn(BATCH, 3, 8, 8, generator=g)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": images}
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "bert":  # every third token masked (none in the padding)
        masked = torch.arange(LENGTH) % 3 == 1
        labels = ids.masked_fill(~masked, -100)
        ids = ids.masked_fill(masked, MASK_ID)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def inputs(name: str, b: dict[str, torch.Tensor]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the model's forward for the batch ``b``."""
    if name == "resnet":
        return (b["pixel_values"],), {}
    return (), (b | {"return_loss": True} if family(name) == "clip" else b)


def loss_of(name: str, forward, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of ``forward`` (the model, or a function called like it) on the batch ``b``."""
    args, kwargs = inputs(name, b)
    out = forward(*args, **kwargs)
    return nn.functional.cross_entropy(out, b["labels"]) if name == "resnet" else out.loss
