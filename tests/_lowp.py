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
