"""materialize on models nobody on the project wrote, against their normal (non-meta) build:
Hugging Face GPT-2 and Llama with their own ``_init_weights``, a ResNet whose constructor
re-initialises its convolutions (as torchvision's does), and a torchtitan-style ``init_weights``
on the root. Random values are compared per tensor by mean and standard deviation (the draws
come at other points of the stream), constants and ``reset_parameters()`` values bit for bit."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes
from funcshard._trees._construction import recorded

from _hf import build
from _mesh import mesh
from _models import ResNet, resnet_init


def mismatches(got: dict, ref: dict) -> list:
    """Tensors of ``got`` whose values are not those of ``ref``: equal, or (for random ones) the
    same mean and standard deviation within 6 standard errors."""
    if list(got) != list(ref):
        return [("keys", list(got), list(ref))]
    bad = []
    for k, b in ref.items():
        a, b = got[k].detach().double(), b.detach().double()
        if torch.equal(a, b):
            continue
        n, std = b.numel(), (b.std().item() if b.numel() > 1 else 0.0)
        if std == 0.0:
            bad.append((k, "differs from a constant"))
        elif abs(a.mean() - b.mean()) > 6 * std / math.sqrt(n) or abs(
            a.std() / std - 1
        ) > 6 / math.sqrt(2 * n):
            bad.append((k, round(a.mean().item(), 4), round(a.std().item(), 4), round(std, 4)))
    return bad


def materialized(meta: nn.Module, **kw):
    """``(full values, buffers, funcshard warnings)`` of materialize on a 1-D mesh of every rank."""
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded, buffers = fs.materialize(meta, mesh(dist.get_world_size()), **kw)
    messages = [str(w.message) for w in caught if "funcshard" in str(w.message)]
    return fs.unshard(sharded), buffers, messages


# Hugging Face ---------------------------------------------------------------------------------


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def hf_model(name: str):
    torch.manual_seed(0)
    ref = _hf(name)  # its post_init ran _init_weights on every module
    with torch.device("meta"):
        meta = _hf(name)  # post_init skips it on meta
    full, buffers, messages = materialized(meta, init=meta._init_weights)
    ref_params, ref_buffers = fs.extract(ref)
    return mismatches(full, ref_params), mismatches(buffers, ref_buffers), messages


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_init_weights(worlds, name, ranks):
    """GPT-2's ``c_proj`` scaled init, written from ``GPT2Attention`` (no tensors of its own)."""
    pytest.importorskip("transformers")
    assert worlds(ranks).run(hf_model, name) == [([], [], [])] * ranks


def hf_without_init():
    with torch.device("meta"):
        meta = _hf("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fs.materialize(meta, mesh(dist.get_world_size()))
        except ValueError as e:  # its RMSNorm has no reset_parameters()
            error = str(e)
    return [str(w.message) for w in caught], error


def test_hugging_face_without_init_says_what_to_pass(world1):
    """Without ``init=``, HF's _init_weights cannot run on meta: a warning says what to pass,
    before the error about the first module it leaves unwritten."""
    pytest.importorskip("transformers")
    ((messages, error),) = world1.run(hf_without_init)
    assert any("init=model._init_weights" in m and "LlamaForCausalLM" in m for m in messages)
    assert "LlamaRMSNorm" in error


def hf_family(name: str) -> tuple:
    """A family of the real-model suite (``_hf``) built under ``fs.on_meta()`` and
    materialised with its ``_init_weights``, against its normal build."""
    ref_params, ref_buffers = fs.extract(build(name))  # seed 0, as below
    with fs.on_meta() as construction:
        meta = build(name)
    full, buffers, messages = materialized(meta, init=meta._init_weights, construction=construction)
    return mismatches(full, ref_params), mismatches(buffers, ref_buffers), messages


@pytest.mark.parametrize(
    "name", ["qwen3", "gemma3", "phi3", "qwen3moe", "deepseek", "whisper", "clip", "mamba"]
)
def test_hugging_face_families_on_meta(world2, name):
    """Equal to the normal build, CLIP's ``logit_scale`` included: a parameter made from
    ``torch.tensor(constant)`` in ``__init__`` that ``_init_weights`` never writes."""
    pytest.importorskip("transformers")
    assert world2.run(hf_family, name) == [([], [], [])] * 2


def clip_on_plain_meta() -> str:
    with torch.device("meta"):
        meta = build("clip")
    try:
        materialized(meta, init=meta._init_weights)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_constant_without_on_meta_says_what_to_pass(world1):
    """Built under ``torch.device("meta")``, CLIP's ``logit_scale`` has no value: the error
    names it and ``fs.on_meta()``."""
    pytest.importorskip("transformers")
    (error,) = world1.run(clip_on_plain_meta)
    assert error.startswith("materialize: 'logit_scale' of the root module (CLIPModel)"), error
    assert "`with fs.on_meta() as construction:`" in error


class Constants(nn.Module):
    """Values made from constants in ``__init__``, none written by a ``reset_parameters()``;
    and one drawn at random."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.6592))  # CLIP's logit_scale
        self.logit = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))  # OpenCLIP's
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # a rotary table
        self.shift = nn.Parameter(torch.zeros(d).add_(0.5))  # written in place
        self.table = nn.Parameter(torch.as_tensor([[1.0, 2.0], [3.0, 4.0]]).t().contiguous())
        self.noise = nn.Parameter(torch.randn(d) * 0.02)  # random: no record


def constants() -> tuple:
    torch.manual_seed(0)
    ref_params, ref_buffers = fs.extract(Constants())
    with fs.on_meta() as construction:
        meta = Constants()

    def init(name, m):  # only the random one
        if name == "":
            m.noise.normal_(std=0.02)

    full, buffers, messages = materialized(meta, init=init, construction=construction)
    same = {k: torch.equal(full[k], v) for k, v in ref_params.items() if k != "noise"}
    same |= {k: torch.equal(buffers[k], v) for k, v in ref_buffers.items()}
    try:
        materialized(meta, construction=construction)  # without init: the random one
    except ValueError as e:
        error = str(e)
    return same, messages, error


def test_on_meta_records_values_made_from_constants(world2):
    """``torch.tensor`` / ``torch.as_tensor`` of data, and what is computed from constants only
    (out of place or in place), are replayed bit for bit; a value computed from a random one
    is not recorded, and is named when nothing writes it."""
    for same, messages, error in world2.run(constants):
        assert same == dict.fromkeys(["scale", "logit", "shift", "table", "inv_freq"], True), same
        assert messages == []
        assert error.startswith("materialize: 'noise' of the root module (Constants)"), error


# ResNet ---------------------------------------------------------------------------------------


def resnet():
    torch.manual_seed(0)
    ref_params, ref_buffers = fs.extract(ResNet())
    out = {}
    with torch.device("meta"):
        meta = ResNet()
    full, buffers, out["meta"] = materialized(meta)
    out["meta"].append(mismatches(full, ref_params) != [])  # the convolutions differ
    full, buffers, out["init"] = materialized(meta, init=resnet_init)
    out["init"] += [mismatches(full, ref_params), mismatches(buffers, ref_buffers)]
    with fs.on_meta() as construction:
        meta = ResNet()
    full, buffers, out["on_meta"] = materialized(meta, construction=construction)
    out["on_meta"] += [mismatches(full, ref_params), mismatches(buffers, ref_buffers)]
    # no re-initialisation: every value is a reset_parameters() value, bit for bit
    torch.manual_seed(1)
    ref = fs.extract(ResNet(reinit=False))
    for how in ("meta", "on_meta"):
        with fs.on_meta() if how == "on_meta" else torch.device("meta") as construction:
            meta = ResNet(reinit=False)
        kw = {"construction": construction} if how == "on_meta" else {}
        full, buffers, messages = materialized(meta, **kw)
        same = [torch.equal(full[k], v) for k, v in ref[0].items()]
        out[f"bitwise {how}"] = [messages, all(same), len(same)]
    return out


def test_resnet_constructor_init(worlds):
    for ranks in (1, 2):
        for out in worlds(ranks).run(resnet):
            (warning,) = out["meta"][:-1]  # one warning, naming the modules
            assert warning.startswith(
                "funcshard.materialize: the tensors of conv1, bn1, layers.0.0.conv1, "
                "layers.0.0.bn1 (+36 more) were initialised while built by something other "
                "than their reset_parameters()"
            ), warning
            assert "fs.on_meta()" in warning and len(warning) < 400
            assert out["meta"][-1] is True
            assert out["init"] == [[], []]  # init= repeats it: no warning, same values
            assert out["on_meta"] == [[], []]  # recorded and replayed
            assert out["bitwise meta"] == out["bitwise on_meta"] == [[], True, 62]


# torchtitan-style init_weights on the root ---------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def init_weights(self, std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class Layer(nn.Module):
    def __init__(self, d: int, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d)
        self.attention = Attention(d)
        self.std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # depth-scaled, as torchtitan's Llama

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(self.std)


class Titan(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 8) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, i) for i in range(layers))
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        cutoff = self.output.weight.shape[1] ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=cutoff, a=-3 * cutoff, b=3 * cutoff)


def _titan_init(name: str, m: nn.Module) -> None:
    if name == "":
        m.init_weights()


def titan():
    torch.manual_seed(0)
    ref = Titan()
    with torch.no_grad():
        ref.init_weights()
    with torch.device("meta"):
        meta = Titan()
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peak, (sharded, _) = peak_bytes(
            lambda: fs.materialize(meta, mesh(dist.get_world_size()), init=_titan_init)
        )
    shards = sum(p.to_local().numel() * 4 for p in sharded.values())
    biggest = max(t.numel() * 4 for t in ref.parameters())
    total = sum(t.numel() * 4 for t in ref.parameters())
    return mismatches(fs.unshard(sharded), fs.extract(ref)[0]), peak, shards, biggest, total


def test_root_init_weights_one_module_at_a_time(world2):
    """The root's ``init_weights`` writes every tensor by name: replayed tensor by tensor, so
    the peak is the shards plus about one module's full tensors (and ``trunc_normal_``'s
    temporaries, and the random state noted before each module), not the model."""
    for bad, peak, shards, biggest, total in world2.run(titan):
        assert bad == []
        assert peak < shards + total / 2, (peak, shards, biggest, total)


# Writes that cannot be replayed: held until the writer's turn, bit for bit ---------------------


class CopiesChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def _copy_init(name: str, m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.1)
    if isinstance(m, CopiesChild):
        m.b.weight.copy_(m.a.weight)  # a meta source: not replayable, so b.weight is held


def held():
    torch.manual_seed(0)
    ref = CopiesChild()
    names = {m: n for n, m in ref.named_modules()}
    with torch.no_grad():
        ref.apply(lambda m: _copy_init(names[m], m))
    with torch.device("meta"):
        meta = CopiesChild()
    torch.manual_seed(0)
    sharded, _ = fs.materialize(meta, mesh(dist.get_world_size()), init=_copy_init)
    full = fs.unshard(sharded)
    return [k for k, v in fs.extract(ref)[0].items() if not torch.equal(full[k], v)]


def test_unreplayable_writes_are_held(world2):
    assert world2.run(held) == [[], []]


def init_that_cannot_run_on_meta():
    meta = CopiesChild().to("meta")
    try:
        fs.materialize(meta, mesh(dist.get_world_size()), init=lambda m: float(m.weight.sum()))
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return " ".join(getattr(e, "__notes__", []))
    return "no error"


def test_init_that_cannot_run_on_meta(world2):
    for note in world2.run(init_that_cannot_run_on_meta):
        assert "calls init on every module" in note and "once on the meta module" in note


def test_on_meta_records_nn_init():
    """The dispatch mode behind ``on_meta`` sees ``nn.init``'s ops with the full tensor's fan
    (fails loudly if a torch upgrade changes TorchDispatchMode or nn.init)."""
    with fs.on_meta() as construction, torch.no_grad():
        conv = nn.Conv2d(4, 6, 3)
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        nn.init.constant_(conv.bias, 0)
        conv.weight.data.mul_(2)  # through .data: the same storage
        conv.bias[0].fill_(1)  # part of a tensor: cannot be replayed
        norm = nn.Parameter(torch.ones(6))
        lin = nn.Linear(3, 5, bias=False)
        nn.init.trunc_normal_(lin.weight, std=0.02)  # a no-op on meta, but recorded
        nn.init.orthogonal_(lin.weight)
    assert isinstance(construction, fs.Construction)
    made, writes = recorded(construction, conv.weight)
    assert made == [] and [op.func.__name__ for op in writes] == [
        "uniform_.default",
        "normal_.default",
        "mul_.Tensor",
    ]
    std = writes[1].kwargs.get("std", writes[1].args[1] if len(writes[1].args) > 1 else None)
    assert std == pytest.approx(math.sqrt(2.0 / (6 * 3 * 3)))
    made, writes = recorded(construction, conv.bias)
    assert [op and op.func.__name__ for op in writes] == ["uniform_.default", "fill_.Scalar", None]
    made, writes = recorded(construction, norm)
    assert [op.func.__name__ for op in made] == ["ones.default"] and writes == []
    made, writes = recorded(construction, lin.weight)
    assert [op.func for op in writes[1:]] == [nn.init.trunc_normal_, nn.init.orthogonal_]
    assert writes[1].kwargs == {"mean": 0.0, "std": 0.02, "a": -2.0, "b": 2.0}


class PartialReinit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.bias[0].fill_(1.0)  # part of a tensor: recorded, not replayable


def partial_write():
    with fs.on_meta() as construction:
        meta = PartialReinit()
    return materialized(meta, construction=construction)[2]


def test_unreplayable_construction_is_named(world1):
    (messages,) = world1.run(partial_write)
    assert len(messages) == 1 and messages[0].startswith(
        "funcshard.materialize: the tensors of lin were initialised while built"
    )
    assert "it wrote part of a tensor, or from another one" in messages[0]
    assert "To fix: do that in init=." in messages[0]
