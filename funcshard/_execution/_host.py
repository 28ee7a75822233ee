"""What a step run without Python may not do on the host: read a device value, or mix host and
device tensors. Checked while ``fs.jit`` traces a step and while ``fs.cuda_graph`` captures one,
naming the operation and the user's line (see [Note: a step as a graph] in ``_cuda_graph``).
"""

from __future__ import annotations

import os
import traceback
from types import TracebackType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._runtime._compat import HigherOrderOperator
from .._trees._tree import flatten

_FUNCSHARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _users(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    for frame in reversed(frames):
        name = os.path.abspath(frame.filename)
        inside = name.startswith(_FUNCSHARD) or name.startswith(_TORCH) or "/contextlib" in name
        if not inside and not name.startswith("<"):
            return frame
    return None


def _symbolic(out) -> bool:
    """Some tensor of ``out`` has a symbolic size."""
    tensors = (x for x in flatten(out)[1] if isinstance(x, torch.Tensor))
    return any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape)


def where(tb: TracebackType | None = None) -> str:
    """The innermost frame outside torch and funcshard -- the user's line -- of ``tb`` (an
    exception's traceback) or of the running stack: ``file:line (code)``."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()[:-1]
    frame = _users(frames)
    if frame is None:
        return "inside funcshard or torch"
    return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"


class HostReads(TorchDispatchMode):
    """Refuses the operations a step without Python cannot run as written, naming them and the
    line that called them: a read of a device value on the host (``.item()``, ``bool(t)``, ...)
    always, and on a non-CPU ``device``, a CPU tensor used with device tensors (a copy between
    them, or a host value that would be frozen). With ``traced`` (a trace on fake tensors of
    static shapes), an operation whose output's shape depends on the values (``nonzero``,
    boolean indexing: a symbolic size) is refused too. ``what``: the error's start, e.g.
    ``"cuda_graph: the step cannot be captured"``; ``found``: the refusal, once one happened."""

    _READS = frozenset(
        {"aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero"}
    )

    def __init__(self, device: torch.device | None, what: str, traced: bool = False) -> None:
        super().__init__()
        self.device, self.what, self.traced = device, what, traced
        self.found: str | None = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """[Note: a compiled step captured]
        ``fs.cuda_graph(torch.compile(step))`` captures the compiled step. Dynamo skips (runs
        eagerly) any frame called while a dispatch mode is active -- with ``fullgraph=True`` it
        raises -- unless the mode ignores compile internals: then the compiled code runs, and
        only its operations outside inductor's kernels pass through the mode (extern kernels,
        custom operators as a whole, and, under ``aot_eager``, every ATen call but those inside
        a higher-order operator, which a mode cannot enter). What the checks then miss, the
        capture itself still refuses (a synchronisation or a copy to the host fails it, and is
        reported), and the host values a replay would freeze are the step's arguments on the
        CPU, refused before the warm-up (``_refuse_host_tensors`` in ``_cuda_graph``). An
        ``fs.jit`` step's compiled code passes through it the same way.
        """
        return True

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):  # see the Note above
            return func(*args, **kwargs)
        name = func._schema.name
        if name in self._READS:
            self._refuse(
                f"{name} reads a device value on the host (.item(), float(t), bool(t) -- an "
                "`if` or `while` on a tensor --, .tolist())"
            )
        off_host = self.device is not None and self.device.type != "cpu"
        if off_host:
            ins = [x for x in flatten((args, kwargs))[1] if isinstance(x, torch.Tensor)]
            target = kwargs.get("device")
            to = None if target is None else torch.device(target).type
            host = [x for x in ins if x.device.type == "cpu" and x.ndim]
            on_device = any(x.device.type != "cpu" for x in ins)
            if (host and (on_device or to not in (None, "cpu"))) or (on_device and to == "cpu"):
                self._mixed(name, host[0] if host else ins[0])
        out = func(*args, **kwargs)
        if self.traced and _symbolic(out):
            self._refuse(
                f"{name} makes a shape from a tensor's values (nonzero, boolean indexing, "
                "unique), which changes from call to call; use fixed shapes (torch.where, masks)"
            )
        if off_host:
            outs = [x for x in flatten(out)[1] if isinstance(x, torch.Tensor)]
            # a 0-dim CPU input is a number (a constant; a changing one, a host count, the
            # optimizer refuses itself); a CPU output of device inputs is a copy to the host
            host += [x for x in outs if x.device.type == "cpu"] if on_device else []
            if host and (on_device or any(x.device.type != "cpu" for x in outs)):
                self._mixed(name, host[0])
        return out

    def _mixed(self, name: str, x: torch.Tensor) -> None:
        self._refuse(
            f"{name} uses a CPU tensor ({list(x.shape)} {x.dtype}) with tensors on "
            f"{self.device}: a copy between host and device, or a CPU value that every call "
            "would reuse as it was at first. Make it on the device, or pass it as a Python number"
        )

    def _refuse(self, what: str) -> None:
        self.found = f"{what}, at {where()}."
        raise RuntimeError(f"{self.what}: {self.found}")
