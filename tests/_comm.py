"""Counting collectives by kind (all_gather / reduce_scatter / all_reduce), whatever c10d API
issued them: functional ops (``torch.func`` paths) or in-place ops (overlapped gathers, FSDP2)."""

from __future__ import annotations

import collections

from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = {
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "all_to_all_single": "all_to_all",
}


def counts(comm: CommDebugMode) -> dict[str, int]:
    """CommDebugMode's counts by kind."""
    out: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():
        kind = KINDS.get(str(op).split(".")[-1], str(op))
        if n:
            out[kind] = out.get(kind, 0) + n
    return out


class Collectives(TorchDispatchMode):
    """Records ``(kind, dtype sent, numel sent)`` for every collective (works under vmap,
    unlike CommDebugMode, whose global module hooks read ``param.data``)."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(func.overloadpacket.__name__)
        if kind is not None and func.namespace in ("_c10d_functional", "c10d"):
            sent = args[1] if func.namespace == "c10d" and kind != "all_reduce" else args[0]
            sent = sent[0] if isinstance(sent, list) else sent
            self.sent.append((kind, sent.dtype, sent.numel()))
        return func(*args, **(kwargs or {}))

    def count(self, kind: str) -> int:
        return sum(1 for k, _, _ in self.sent if k == kind)

    def counts(self) -> dict[str, int]:
        """How many of each kind, as :func:`counts` (without CommDebugMode's module hooks,
        which fail on some transformers models: T5's decoder, ViT)."""
        return dict(collections.Counter(k for k, _, _ in self.sent))
