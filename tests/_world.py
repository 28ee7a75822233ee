"""A pool of real gloo ranks on localhost, started once per pytest session and reused.

``World(n).run(fn, *args)`` runs the picklable, module-level ``fn(*args)`` on every rank and
returns the per-rank results. An exception on any rank fails the call with every rank's
traceback; a rank stuck in a collective fails it after ``timeout`` seconds. After a failure the
ranks are killed and restarted on the next call, so one bug cannot hang or poison later tests.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import socket
import sys
import traceback


class RankError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, conn, path: list[str], backend: str) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    while (msg := conn.recv()) is not None:
        fn, args, kwargs = msg
        try:
            result = ("ok", fn(*args, **kwargs))
        except BaseException:
            result = ("err", traceback.format_exc())
        try:
            conn.send(result)
        except Exception:
            conn.send(("err", f"rank {rank}: result of {fn.__name__} is not picklable"))
    dist.destroy_process_group()


class World:
    def __init__(self, size: int, backend: str = "gloo") -> None:
        self.size, self.backend = size, backend
        self._ranks: list[tuple[mp.Process, object]] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        env = {"OMP_NUM_THREADS": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for rank in range(self.size):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_serve,
                    args=(rank, self.size, port, child, list(sys.path), self.backend),
                    daemon=True,
                )
                p.start()
                self._ranks.append((p, parent))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def run(self, fn, *args, timeout: float = 240, **kwargs) -> list:
        if not self._ranks:
            self._start()
        for _, conn in self._ranks:
            conn.send((fn, args, kwargs))
        results, errors = [None] * self.size, {}
        deadline = timeout
        for rank, (_proc, conn) in enumerate(self._ranks):
            if not conn.poll(deadline if not errors else 5):
                errors[rank] = f"rank {rank}: no result after {deadline}s (hung in a collective?)"
                continue
            status, value = conn.recv()
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            self.close(kill=True)
            raise RankError(
                f"{getattr(fn, '__name__', fn)} failed:\n"
                + "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            )
        return results

    def close(self, kill: bool = False) -> None:
        for proc, conn in self._ranks:
            if kill:
                proc.kill()
            else:
                try:
                    conn.send(None)
                except OSError:
                    proc.kill()
        for proc, _ in self._ranks:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self._ranks = []


@functools.cache
def mesh(*shape: int, names: tuple[str, ...] | None = None, device: str = "cpu"):
    """A cached DeviceMesh in a rank process (2-D meshes create process groups once)."""
    from torch.distributed.device_mesh import init_device_mesh

    if names is None and len(shape) == 2:
        names = ("replicate", "shard")
    return init_device_mesh(device, shape, mesh_dim_names=names)
