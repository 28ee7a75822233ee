"""Checksums of a checkpoint's data, and save failures raised as exceptions naming their cause.

[Note: checksums]
DCP stores no checksums. funcshard's writer reads back, after DCP wrote and fsynced them, the
bytes of every item this rank wrote (a tensor chunk or a pickled value: a byte range of one of
its files) and computes their CRC-32 (``zlib.crc32``, about 3.5 GB/s on one core here); the list
travels to rank 0 with DCP's own write results (no collective of its own), and rank 0 adds the
CRC-32 of ``.metadata`` and puts both in the manifest. At load, every rank checks ``.metadata``
before unpickling it, and checks the byte ranges it is about to read (only those: a resharded
load reads parts of other ranks' files) before DCP reads them; a mismatch is raised inside
DCP's read step, so DCP gathers it and every rank raises the same error, naming the file, the
key and the byte range. Checkpoints without checksums (written by an earlier funcshard, or by
DCP alone) load unverified. Cost: one extra read of what is written or read, from the page
cache, plus the CRC: about 0.5 CPU-seconds per GB on save and on load (measured by
``benchmarks/checkpoint_checksums.py``; see docs/checkpoint.md).

[Note: save failures name their cause]
DCP reports a failed write as a ``CheckpointException``: a ``BaseException``, which
``except Exception`` does not catch, whose cause may be buried: a full disk under
``torch.save`` surfaces as ``RuntimeError: [enforce fail at inline_container.cc] unexpected
pos``, with the ``OSError`` (``No space left on device``) only as its ``__context__``, which is
lost when DCP sends the failure to the other ranks (exceptions are pickled without their
chain). So the writer replaces, on the rank where it happens, a failure whose chain holds an
``OSError`` by that ``OSError``; ``save`` (and ``Saving.wait``) then raise on every rank an
``OSError`` with the same errno (``except OSError``, ``e.errno == errno.ENOSPC`` work), whose
message names the checkpoint, the failing ranks and the cause, after rank 0 removed the
temporary directory.
"""

from __future__ import annotations

import errno
import os
import zlib
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

ALGORITHM = "crc32"
_CHUNK = 16 << 20  # bytes read at a time


def crc32(path: str, offset: int = 0, length: int | None = None) -> int:
    """The CRC-32 of ``length`` bytes of ``path`` from ``offset`` (to the end: ``None``)."""
    crc = 0
    size = _CHUNK if length is None else max(1, min(_CHUNK, length))
    buffer = memoryview(bytearray(size))  # read into one buffer: no allocation per chunk
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            n = f.readinto(buffer if left is None else buffer[: min(size, left)])
            if not n:
                break
            crc = zlib.crc32(buffer[:n], crc)
            if left is not None:
                left -= n
    return crc


class _Written(list):
    """A rank's DCP write results, with the checksums of what it wrote (``{file: [[offset,
    length, crc32], ...]}``); a list, so DCP handles it as the plain list it expects."""

    checksums: dict[str, list[list[int]]]


class Writer(dcp.FileSystemWriter):
    """DCP's file system writer, plus checksums; see [Note: checksums].

    After ``dcp.save``, ``checksums`` holds (on the coordinator, rank 0) the manifest entry.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self.checksums: dict[str, Any] | None = None

    def write_data(self, plan, planner) -> Future:
        try:
            written = _Written(super().write_data(plan, planner).wait())
            written.checksums = {}
            for info in sorted((r.storage_data for r in written), key=_place):
                crc = crc32(os.path.join(self.path, info.relative_path), info.offset, info.length)
                written.checksums.setdefault(info.relative_path, []).append(
                    [info.offset, info.length, crc]
                )
        except Exception as e:
            raise _os_cause(e) from e
        out: Future = Future()
        out.set_result(written)
        return out

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
            files: dict[str, list[list[int]]] = {}
            for written in results:
                files.update(getattr(written, "checksums", {}))
            self.checksums = {
                "algorithm": ALGORITHM,
                ".metadata": crc32(os.path.join(self.path, ".metadata")),
                "files": files,
            }
        except Exception as e:
            raise _os_cause(e) from e


def _place(info) -> tuple[str, int]:
    return info.relative_path, info.offset


def _os_cause(e: BaseException) -> BaseException:
    """The first ``OSError`` in ``e``'s chain, rebuilt (so that it pickles with its errno and
    file name), else ``e``; see [Note: save failures name their cause]."""
    seen = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            if cause.errno is None:
                return type(cause)(*cause.args)
            if cause.filename is None:
                return OSError(cause.errno, cause.strerror)
            return OSError(cause.errno, cause.strerror, cause.filename)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return e


def save_failed(fn: str, path: str, tmp: str, e: CheckpointException) -> Exception:
    """The exception ``fn`` raises on every rank for a failed DCP save (``e``: gathered by DCP,
    the same on every rank): an ``OSError`` (with the cause's errno) if the cause is one, else
    a ``RuntimeError``."""
    failures = getattr(e, "failures", {}) or {}
    ranks = sorted(failures)
    first = failures[ranks[0]][0] if ranks else e
    lines = str(first).strip().splitlines() or [""]
    cause = f"{type(first).__name__}: {lines[-1]}"
    code = first.errno if isinstance(first, OSError) else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        what = "free space there (or keep fewer checkpoints: keep=K)"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = f"make {os.path.dirname(path)} writable by every rank"
    else:
        what = "fix the cause"
    message = (
        f"{fn}: writing the checkpoint {path} failed on rank(s) {ranks or '?'}: {cause}. "
        f"Nothing was committed: the partial files ({tmp}) were removed and the earlier "
        f"checkpoints are intact; {what} and save again."
    )
    if not isinstance(first, OSError):
        return RuntimeError(message)
    return OSError(code, message) if code is not None else OSError(message)


class DataDamaged(RuntimeError):
    """A data range whose checksum does not match the manifest's (raised inside DCP's read)."""


class Reader(dcp.FileSystemReader):
    """DCP's file system reader, checking each byte range against the manifest's checksums
    before DCP reads it; see [Note: checksums]."""

    def __init__(self, path: str, checksums: dict[str, Any], storage_data: dict) -> None:
        super().__init__(path)
        self._root = path
        self._storage = storage_data
        self._sums = {
            (file, offset): (length, crc)
            for file, items in checksums.get("files", {}).items()
            for offset, length, crc in items
        }

    def read_data(self, plan, planner):
        wanted = {}
        for item in plan.items:
            info = self._storage[item.storage_index]
            wanted.setdefault((info.relative_path, info.offset), (info.length, item))
        for (name, offset), (length, item) in sorted(wanted.items(), key=lambda kv: kv[0]):
            file = os.path.join(self._root, name)
            saved = self._sums.get((name, offset))
            found = crc32(file, offset, length)
            if saved is None or saved != (length, found):
                where = f"bytes {offset}..{offset + length} (key {item.storage_index.fqn!r})"
                detail = (
                    "are not listed in the manifest's checksums"
                    if saved is None or saved[0] != length
                    else f"have CRC-32 {found:08x}, saved with {saved[1]:08x}"
                )
                raise DataDamaged(
                    f"{file} is damaged: its {where} {detail}. The checkpoint {self._root} "
                    "changed after it was saved (a flipped bit on disk or in a copy, an "
                    "overwrite); load an earlier one."
                )
        return super().read_data(plan, planner)


def check_metadata(path: str, checksums: dict[str, Any] | None) -> None:
    """Raise if ``.metadata`` does not match its checksum in the manifest (if it has one)."""
    if not checksums or ".metadata" not in checksums:
        return
    file = os.path.join(path, ".metadata")
    found = crc32(file)
    if found != checksums[".metadata"]:
        raise RuntimeError(
            f"{file} is damaged: its CRC-32 is {found:08x}, saved with "
            f"{checksums['.metadata']:08x}. The checkpoint {path} changed after it was saved; "
            "load an earlier one."
        )


def damaged(e: CheckpointException) -> RuntimeError | None:
    """The checksum error among the failures DCP gathered from the ranks' reads, if any."""
    for _, (failure, _trace) in sorted((getattr(e, "failures", {}) or {}).items()):
        if isinstance(failure, DataDamaged):
            return RuntimeError(str(failure))
    return None
