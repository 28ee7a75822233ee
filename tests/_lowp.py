"""Low-precision weights for the tests of FSDP2's all-gather protocol: a tensor subclass of our
own (int8 rows with a float32 scale per row on the wire), QLoRA over torchao's NF4 and
torchao's float8 training, with the unsharded references they are compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from _comm import Collectives

# what the subclass keeps as a subclass (as torchao's float8 weight does): FSDP2's sharding ops
# and the in-place updates of an optimizer; anything else returns plain tensors
_KEPT_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.empty_like.default,
}


class Int8Rows(torch.Tensor):
    """A float32 weight that all-gathers itself as int8 rows and one float32 scale per row
    (FSDP2's protocol, its one-argument form), rebuilt as the dequantized weight. ``Int8Rows5``
    has the five-argument form; ``skip`` removes an op from what the subclass supports."""

    skip: frozenset = frozenset()

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device,
            requires_grad=data.requires_grad,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self):
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, size, stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in cls.skip:
            raise NotImplementedError(f"{cls.__name__} does not implement {func}")
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEPT_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(self, mesh):
        return quantize(self._data), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        full = dequantize(*outputs, param_dtype)
        if out is not None:  # autograd saved ``out`` for backward: its version must not move
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.detach().copy_(full)
            return None
        return full, (full,)


class Int8Rows5(Int8Rows):
    """:class:`Int8Rows` with FSDP2's five-argument ``fsdp_pre_all_gather``: it casts the scales
    to the mixed-precision policy's ``param_dtype``, as torchao's int8 training weights do."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        assert tuple(outer_size)[1:] == tuple(self.shape)[1:], (outer_size, self.shape)
        q, scale = quantize(self._data)
        return (q, scale.to(mp_policy.param_dtype or scale.dtype)), None


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return (w / scale).round().clamp(-127, 127).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)


class _Straight(torch.autograd.Function):
    """The weight as the protocol rebuilds it; its gradient passed straight to the weight."""

    @staticmethod
    def forward(w, dtype):
        return dequantize(*quantize(w), dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype), None


def int8_mlp(cls=Int8Rows, seed: int = 0) -> nn.Sequential:
    """Three linears, the first and last with biases; their weights are ``cls`` (``None``:
    plain, for :func:`int8_reference`)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 8)
    )
    for m in model:
        if isinstance(m, nn.Linear) and cls is not None:
            m.weight = nn.Parameter(cls(m.weight.detach().clone()))
    return model


def int8_reference(model: nn.Sequential, x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``model``'s output (plain weights: ``int8_mlp(None)``) with each weight as the protocol
    rebuilds it, unsharded; the weight's gradient is the rebuilt weight's."""
    for m in model:
        if isinstance(m, nn.Linear):
            w = _Straight.apply(m.weight, dtype)
            b = None if m.bias is None else m.bias.to(dtype)
            x = F.linear(x.to(dtype), w, b)
        else:
            x = m(x)
    return x


def gathered_bytes(c: Collectives, world: int) -> int:
    """The bytes all-gathered (received by each rank) in ``c``'s collectives."""
    size = {d: torch.empty((), dtype=d).element_size() for _, d, _ in c.sent}
    return sum(world * n * size[d] for k, d, n in c.sent if k == "all_gather")


# ---- torchao: NF4 QLoRA and float8 training -----------------------------------------------


def to_nf4(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """torchao's NF4 with blocks small enough for the tests' tiny weights to split over 4 ranks
    (each rank's shard must hold whole blocks of scales: ``block`` x ``block`` values here, 64 x
    256 in torchtune's defaults)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as nf4

    return nf4(w, block_size=block, scaler_block_size=block)


class LoRALinear(nn.Module):
    """torchtune's QLoRA linear: a frozen NF4 weight plus a trained low-rank update
    ``scale * B(A(x))`` (``B`` starts non-zero here so that every gradient is non-zero)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0, base=None,
                 block: int = 32) -> None:  # fmt: skip
        super().__init__()
        base = nn.Linear(d_in, d_out, bias=False) if base is None else base
        self.weight = nn.Parameter(to_nf4(base.weight.detach(), block), requires_grad=False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        self.scale = alpha / rank

    def forward(self, x):
        return F.linear(x, self.weight) + self.scale * self.lora_b(self.lora_a(x))


class QLoRAMLP(nn.Module):
    """Two QLoRA blocks and a trained norm: NF4 weights and float32 adapters in each group."""

    def __init__(self, d: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.up = LoRALinear(d, hidden)
        self.down = LoRALinear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))))


def qlora_mlp(seed: int = 0) -> QLoRAMLP:
    torch.manual_seed(seed)
    return QLoRAMLP()


def float8_mlp(fsdp_float8_all_gather: bool, bias: bool = True, seed: int = 0) -> nn.Sequential:
    """torchao's float8 training (``convert_to_float8_training``) on three linears of widths
    divisible by 16 (``torch._scaled_mm``); ``bias=False`` leaves the middle one without bias."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64, bias=bias), nn.GELU(), nn.Linear(64, 32)
    )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    return convert_to_float8_training(model, config=config)


def qlora(model: nn.Module, block: int = 16) -> nn.Module:
    """A QLoRA fine-tune's model: every linear of the decoder layers becomes a
    :class:`LoRALinear` over its NF4-quantized weight, everything else is frozen (as torchtune's
    ``lora_llama`` and PEFT's ``get_peft_model`` after ``prepare_model_for_kbit_training``)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for name, sub in list(layer.named_modules()):
            if isinstance(sub, nn.Linear):
                owner = layer.get_submodule(name.rpartition(".")[0])
                lora = LoRALinear(sub.in_features, sub.out_features, base=sub, block=block)
                setattr(owner, name.rpartition(".")[2], lora)
    return model
