"""A dispatch-mode recorder of c10d functional collectives (works under vmap, unlike
CommDebugMode, whose global module hooks read ``param.data``)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class Collectives(TorchDispatchMode):
    """Records ``(collective name, dtype sent, numel sent)`` for every functional collective."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name != "wait_tensor":
            self.sent.append((name, args[0].dtype, args[0].numel()))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(1 for n, _, _ in self.sent if n == name)
