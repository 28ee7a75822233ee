"""What the checkpoint checksums cost, per GB: save and load with and without them.

    python -m benchmarks.checkpoint_checksums [--mib 512 --rounds 5 --dir /fast/disk]

One process writes a tree of ``--mib`` MiB of float32 tensors (64 MiB each, plus a few small
ones and a scalar) with DCP's ``FileSystemWriter`` (``sync_files=True``, as
``fs.checkpoint.save`` uses it) and with funcshard's checksumming writer, and reads it back with
DCP's ``FileSystemReader`` and with funcshard's verifying reader, interleaved, into a fresh
directory each time (``--dir``: default a temporary one). The data is read back from the page
cache (just written), as it is after a save; a load from cold storage pays the disk read once
either way. Both readers read the same (checksummed) files; the order alternates per round.
Also: ``zlib.crc32`` alone over the same bytes in memory. Reports medians, in seconds per GB:
wall time, the process's CPU time, and the CPU time spent reading back and checksumming (which
is the checksums' cost; on a shared machine the wall times mostly measure the others' load).
Nothing is asserted: numbers for people.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
import zlib

import torch
import torch.distributed.checkpoint as dcp

from funcshard.checkpoint import _integrity
from funcshard.checkpoint._integrity import Reader, Writer


def tree(mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    big = {f"w{i}": torch.randn(16 << 20, generator=g) for i in range(mib // 64)}
    small = {f"b{i}": torch.randn(1000, generator=g) for i in range(8)}
    return {**big, **small, "step": 7}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)  # DCP: saving in one process without a group
    state = tree(args.mib)
    nbytes = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    gb = nbytes / 1e9
    root = args.dir or tempfile.mkdtemp(prefix="funcshard-crc-")
    rows: dict[str, list[float]] = {k: [] for k in ("save", "save+crc", "load", "load+crc")}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    in_crc = [0.0]  # CPU seconds spent inside the checksum function (read back + CRC)
    checksum = _integrity.crc32

    def counted(*a, **k):
        t0 = time.process_time()
        try:
            return checksum(*a, **k)
        finally:
            in_crc[0] += time.process_time() - t0

    _integrity.crc32 = counted
    crc_cpu: dict[str, list[float]] = {"save+crc": [], "load+crc": []}

    def timed(fn, name) -> None:
        in_crc[0] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        rows[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
        if name in crc_cpu:
            crc_cpu[name].append(in_crc[0])

    for i in range(args.rounds):
        plain, written = os.path.join(root, f"plain_{i}"), os.path.join(root, f"crc_{i}")
        writers = {
            "save": (plain, dcp.FileSystemWriter(plain, sync_files=True, overwrite=True)),
            "save+crc": (written, Writer(written)),
        }
        for name in sorted(writers, reverse=i % 2 == 1):  # alternate which goes first
            writer = writers[name][1]
            save = lambda w=writer: dcp.save(state, storage_writer=w, no_dist=True)
            timed(save, name)
        storage = dcp.FileSystemReader(written).read_metadata().storage_data
        readers = {  # both read the same files
            "load": dcp.FileSystemReader(written),
            "load+crc": Reader(written, writers["save+crc"][1].checksums, storage),
        }
        for name in sorted(readers, reverse=i % 2 == 1):
            target = {k: torch.empty_like(v) if torch.is_tensor(v) else v for k, v in state.items()}
            reader = readers[name]
            timed(lambda r=reader: dcp.load(target, storage_reader=r, no_dist=True), name)  # noqa: B023
        shutil.rmtree(plain)
        shutil.rmtree(written)
    data = memoryview(b"".join(v.numpy().tobytes() for k, v in state.items() if k.startswith("w")))
    t0 = time.process_time()
    zlib.crc32(data)
    crc = (time.process_time() - t0) / (len(data) / 1e9)
    wall = {k: statistics.median(v) / gb for k, v in rows.items()}
    used = {k: statistics.median(v) / gb for k, v in cpu.items()}
    print(
        f"{gb:.2f} GB, {args.rounds} rounds, medians, seconds per GB (load average "
        f"{os.getloadavg()[0]:.1f} at the end); CPU: this process's CPU time"
    )
    print(f"zlib.crc32 in memory: {crc:.2f} CPU s/GB")
    for op in ("save", "load"):
        inside = statistics.median(crc_cpu[f"{op}+crc"]) / gb
        print(
            f"{op}: wall {wall[op]:.2f} -> {wall[op + '+crc']:.2f} s/GB with checksums; CPU "
            f"{used[op]:.2f} -> {used[op + '+crc']:.2f} s/GB, of which {inside:.2f} reading "
            "back and checksumming"
        )
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
