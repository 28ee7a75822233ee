"""The rank side of a testing pool: join the process group, then run what the parent sends.

Everything here runs in a rank process (see ``_pool.py`` for the parent side). The messages are
bytes: the parent sends ``cloudpickle.dumps((fn, args, kwargs))`` (``b""`` to stop), a rank
answers ``pickle.dumps(Reply)``, whose ``blob`` is pickled separately so that a result the
parent cannot load is reported as such instead of losing the whole reply.

[Note: results by value]
A rank's result is sent back by value through the pipe: DTensors become their *local* shards
(gathering needs every rank to take part, which only ``fn`` can arrange: call
``full_tensor()`` there, or compare on the ranks with ``fs.testing.assert_close``), LocalShards
their tensors, and every tensor is detached, moved to the CPU, and copied out of a larger
storage it may view. Containers (dicts, lists, tuples, named tuples, ...) are walked with optree;
other objects are pickled as they are. The plain pickler is used, not multiprocessing's, which
torch teaches to pass tensors through shared memory (a file descriptor per tensor, tied to the
lifetime of a rank that the parent may kill).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import optree
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from .._trees._spec import LocalShard

# (rank, world) while this process is a rank of a pool; see _pool.Pool.run.
CURRENT: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a rank needs to join its pool's process group."""

    rank: int
    world: int
    backend: str
    port: int  # the parent's TCPStore, on 127.0.0.1
    prefix: str  # a fresh key prefix per start of the pool
    timeout: float  # seconds, for the store and the process group's collectives
    threads: int | None
    directory: str  # where this rank writes its output and, when asked, its stack


class Reply(NamedTuple):
    """``status``: ``ready`` (joined), ``ok`` (``blob`` is the result), ``err`` (``text`` is
    the traceback, ``blob`` the exception if it pickles) or ``died`` (made by the parent)."""

    status: str
    text: str = ""
    blob: bytes | None = None


def files(directory: str | Path, rank: int) -> dict[str, Path]:
    """The per-rank files: ``out`` and ``err`` (the rank's sys.stdout / sys.stderr during the
    last call) and ``stack`` (faulthandler's dump on SIGUSR1)."""
    return {k: Path(directory) / f"rank{rank}.{k}" for k in ("out", "err", "stack")}


def serve(setup: Setup, conn) -> None:
    """The rank's main loop: join, say ``ready``, then run calls until ``b""`` or EOF."""
    global CURRENT
    CURRENT = (setup.rank, setup.world)
    try:
        outputs = _join(setup)
    except BaseException:
        conn.send_bytes(pickle.dumps(Reply("err", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(Reply("ready")))
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:  # the parent is gone
            break
        if not msg:
            break
        for f in outputs:
            f.seek(0)
            f.truncate()
        reply = _call(msg)
        for f in outputs:
            f.flush()
        conn.send_bytes(pickle.dumps(reply))
    dist.destroy_process_group()


def _join(setup: Setup) -> list:
    """Environment as torchrun's, threads, stack dumps on SIGUSR1, output files, the group."""
    os.environ.update(
        RANK=str(setup.rank),
        LOCAL_RANK=str(setup.rank),
        WORLD_SIZE=str(setup.world),
        LOCAL_WORLD_SIZE=str(setup.world),
    )
    if setup.threads:
        torch.set_num_threads(setup.threads)
    paths = files(setup.directory, setup.rank)
    # these files stay open for the life of the rank
    if hasattr(signal, "SIGUSR1"):
        stack = open(paths["stack"], "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    sys.stdout = open(paths["out"], "w", buffering=1)  # noqa: SIM115
    sys.stderr = open(paths["err"], "w", buffering=1)  # noqa: SIM115
    if "nccl" in setup.backend:
        torch.cuda.set_device(setup.rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=setup.timeout)
    store = dist.TCPStore("127.0.0.1", setup.port, is_master=False, timeout=timeout)
    dist.init_process_group(
        setup.backend,
        store=dist.PrefixStore(setup.prefix, store),
        rank=setup.rank,
        world_size=setup.world,
        timeout=timeout,
    )
    return [sys.stdout, sys.stderr]


def _call(msg: bytes) -> Reply:
    name = "fn"
    try:
        fn, args, kwargs = pickle.loads(msg)
        name = getattr(fn, "__qualname__", repr(fn))
        result = fn(*args, **kwargs)
    except BaseException as e:
        return Reply("err", traceback.format_exc(), _exception_blob(e))
    try:
        return Reply("ok", blob=cloudpickle.dumps(to_host(result)))
    except Exception as e:
        return Reply(
            "err",
            f"{name} returned a result that cannot be sent back to the test process ({e!r}).\n"
            "Return tensors, numbers, strings and containers of them.\n",
        )


def _exception_blob(e: BaseException) -> bytes | None:
    try:
        return cloudpickle.dumps(e)
    except Exception:
        return None


def to_host(tree: Any) -> Any:
    """``tree`` with its tensors by value. See [Note: results by value]."""
    return optree.tree_map(_host, tree, none_is_leaf=True)


def _host(x: Any) -> Any:
    if isinstance(x, DTensor):
        x = x.to_local()
    elif isinstance(x, LocalShard):
        x = x.tensor
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, AsyncCollectiveTensor):
        x = x.wait()
    x = x.detach()
    if x.device.type not in ("cpu", "meta"):
        x = x.cpu()
    strided = x.layout == torch.strided and x.device.type == "cpu"
    if strided and x.untyped_storage().nbytes() > x.numel() * x.element_size():
        x = x.clone()  # a view: send its elements, not its whole storage
    return x
