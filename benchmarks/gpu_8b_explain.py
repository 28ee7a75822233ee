"""Part ``gpu_8b_explain``: ``fs.explain`` of ``gpu_8b``'s funcshard step, and the step itself.

``--predict``: for each recompute form of funcshard's plan (every block; every block but the
last ``KEEP``), one rank's step of the 8-rank job explained on fake tensors with
``Hardware.h100()`` (an H100 SXM at 60% of its peaks, NVLink at 80% of 450 GB/s between the 8
ranks): its peak, the compute lane alone, the exposed communication and the predicted step.
No GPU work (the fake tensors are only shapes), so it can run beside ``gpu_8b``'s measurement;
its exposed communication goes beside every row of the 8B table.

``--check`` (after ``gpu_8b``, on the GPU): funcshard's eager step, every block recomputed --
``gpu_8b``'s row of it (``gpu8b-<device>.json`` in ``--out``: what the variant keeps between
steps + ``torch.cuda.max_memory_allocated`` above a step's start, and the median step), or,
where that row is missing, the step built alone here (two steps, one whose
``max_memory_allocated`` after ``reset_peak_memory_stats`` is taken, ``--rounds`` timed) --
against explain's peak (target within 5%) and explain's compute lane (the fake group moves
nothing, so the measured step has no communication to compare; target within 20%), with
``Hardware.h100()`` (``--predict``'s explanation when written) and with rates measured on this
GPU (``Hardware.measure(device="cuda")``). On the CPU (``--quick``) the peak is the allocator's
(part ``memory``'s accounting) and the rates are the CPU's.

They write ``gpu8b-predict-<device>.json`` and ``gpu8b-check-<device>.json``, rewritten after
each explain and each measurement.

    python -m benchmarks.gpu_8b_explain --predict            # about a minute of CPU
    python -m benchmarks.gpu_8b_explain --check              # on the GPU
    python -m benchmarks.gpu_8b_explain --predict --check --quick --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import funcshard as fs

from . import gpu, gpu_8b, harness
from .fake import fake_world
from .variants import VARIANTS, plan_for
from .workloads import _lm_loss

FORMS = (gpu_8b.FULL, gpu_8b.BLOCKS)


def explanation(s: gpu_8b.Shape, form: str, mesh, hardware: fs.Hardware) -> fs.Explanation:
    """``fs.explain`` of rank 0's step of ``s`` on ``mesh``: the plan, dtypes, loss and AdamW
    of ``gpu_8b``'s funcshard variant, on the meta model's shapes."""
    w = gpu_8b.workload(s, torch.device(mesh.device_type), gpu_8b.Initial())
    o = gpu_8b.options(form, s, "inductor")
    model = w.build()
    apply = fs.schedule(model, plan_for(w, model, o), param_dtype=o.param_dtype,
                        reduce_dtype=o.reduce_dtype)  # fmt: skip
    params, buffers = fs.extract(model)
    tokens = torch.zeros(s.batch, s.seq, dtype=torch.long, device="meta")
    opt = fs.optim.adamw(o.lr, weight_decay=o.weight_decay, fused=True)
    return fs.explain(
        apply, fs.shard(params, mesh), tokens, optimizer=opt, buffers=buffers,
        loss=lambda out, t: _lm_loss(out, (t,)), hardware=hardware,
    )  # fmt: skip


def summary(e: fs.Explanation, seconds: float) -> dict[str, Any]:
    return {
        "peak_bytes": e.peak_bytes,
        "peak_at": f"{e.peak_at.step.group or 'the root'}'s {e.peak_at.step.op}",
        "at_peak": e.at_peak,
        "compute_s": e.compute_s,
        "communication_s": e.communication_s,
        "exposed_communication_s": e.exposed_communication_s,
        "predicted_step_s": e.predicted_step_s,
        "flops": e.flops,
        "operators": e.operators,
        "hardware": e.hardware.name,
        "explain_s": seconds,
    }


def predict(s: gpu_8b.Shape, device: str, save) -> dict[str, Any]:
    """Each form explained with ``Hardware.h100()``; ``save()`` after each."""
    forms: dict[str, Any] = {}
    out = {"tokens": s.batch * s.seq, "keep": gpu_8b.KEEP[s], "forms": forms}
    with fake_world(s.world, device=device) as mesh:
        for form in FORMS:
            t0 = time.perf_counter()
            e = explanation(s, form, mesh, fs.Hardware.h100())
            forms[form] = summary(e, time.perf_counter() - t0)
            print(f"[gpu_8b_explain] {form}: peak {e.peak_bytes / 2**30:.2f} GiB, compute "
                  f"{e.compute_s:.2f} s, exposed communication {e.exposed_communication_s:.3f} "
                  f"s ({forms[form]['explain_s']:.0f} s)", flush=True)  # fmt: skip
            save(out)
    return out


def check(s: gpu_8b.Shape, device: torch.device, rounds: int, found: dict, save) -> dict:
    """funcshard's eager step, every block recomputed, against its explanation with
    ``Hardware.h100()`` (``found["predicted"]``'s when there) and with rates measured here.
    The step: ``found["row"]``, ``gpu_8b``'s row of it, when that has a time and a peak; else
    measured here alone (``_alone``)."""
    out: dict[str, Any] = {}
    row = found.get("row") or {}
    with fake_world(s.world, device=device.type) as mesh:
        if "ms" in row and "peak_bytes" in row:
            out["measured_peak_bytes"], out["measured_step_s"] = row["peak_bytes"], row["ms"] / 1e3
            out["peak_measured_by"] = (
                "gpu_8b's row: what the variant keeps + torch.cuda.max_memory_allocated above a "
                "step's start" if device.type == "cuda" else "gpu_8b's row (the allocator's events)"
            )  # fmt: skip
        else:
            out.update(_alone(s, device, mesh, rounds))
        save(out)
        predicted, dev = found.get("predicted", {}).get(gpu_8b.FULL), device.type
        rates = {"h100": fs.Hardware.h100, "measured": lambda: fs.Hardware.measure(device=dev)}
        for name, hardware in rates.items():
            t0 = time.perf_counter()
            try:
                if name == "h100" and predicted is not None:
                    e = dict(predicted)
                else:
                    e = summary(explanation(s, gpu_8b.FULL, mesh, hardware()), 0.0)
                    e["explain_s"] = time.perf_counter() - t0
            except Exception as error:  # recorded: the other rates still compare
                out[name] = gpu._failure(error, f"explain with {name} rates")
                continue
            e["peak_error"] = e["peak_bytes"] / out["measured_peak_bytes"] - 1
            e["step_error"] = e["compute_s"] / out["measured_step_s"] - 1
            out[name] = e
            save(out)
    return out


def _alone(s: gpu_8b.Shape, device: torch.device, mesh, rounds: int) -> dict[str, Any]:
    """funcshard's eager step built alone as ``gpu_8b`` builds it: two steps, then one whose
    peak (``_peak``) is taken, then the median of ``rounds`` steps."""
    w = gpu_8b.workload(s, device, gpu_8b.Initial())
    trainer = VARIANTS["funcshard"](w, mesh, gpu_8b.options(gpu_8b.FULL, s, "inductor"))
    w.shards.clear()
    batches = [w.batch(i, 0) for i in range(3 + rounds)]
    for batch in batches[:2]:
        trainer.step(batch)
    out: dict[str, Any] = {"measured_peak_bytes": _peak(trainer, batches[2], device)}
    out["peak_measured_by"] = (
        "torch.cuda.max_memory_allocated" if device.type == "cuda" else "the allocator's events"
    )
    times = []
    for batch in batches[3:]:
        harness.sync(device)
        t0 = time.perf_counter()
        trainer.step(batch)
        harness.sync(device)
        times.append(time.perf_counter() - t0)
    out["measured_step_s"] = statistics.median(times)
    return out


def _peak(trainer, batch, device: torch.device) -> int:
    """The most bytes allocated during one step: CUDA's counter over the whole process; CPU:
    the allocator's events (``memory.profile_step``, the resident categories included)."""
    if device.type != "cuda":
        return gpu._peak_bytes(trainer, {}, batch, device)
    harness.sync(device)
    torch.cuda.reset_peak_memory_stats()
    trainer.step(batch)
    harness.sync(device)
    return torch.cuda.max_memory_allocated()


def _found(folder: Path, device: str) -> dict[str, Any]:
    """What ``--check`` reuses from ``folder``: ``gpu_8b``'s funcshard row with every block
    recomputed (``row``) and ``--predict``'s explanations (``predicted``), where written."""
    found: dict[str, Any] = {}
    rows, predicted = folder / f"gpu8b-{device}.json", folder / f"gpu8b-predict-{device}.json"
    if rows.exists():
        sets = json.loads(rows.read_text())["result"]["sets"]
        found["row"] = sets.get("full AC", {}).get("funcshard")
    if predicted.exists():
        found["predicted"] = json.loads(predicted.read_text())["result"].get("forms", {})
    return found


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict", action="store_true", help="explain each form (CPU work only)")
    ap.add_argument("--check", action="store_true", help="the eager step against explain")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps of --check")
    ap.add_argument("--out", type=Path, help="results folder")
    args = ap.parse_args(argv)
    if not (args.predict or args.check):
        ap.error("give --predict, --check or both")
    device = torch.device(args.device)
    s = gpu_8b.TINY if args.quick else gpu_8b.LLAMA_8B
    out = args.out or (harness.RESULTS / "quick" if args.quick else harness.RESULTS)

    def save(kind: str):
        """``gpu8b-<kind>-<device>.json`` (each mode its own file: they may run at once)."""
        info = {"part": "gpu_8b_explain", "quick": args.quick, "machine": harness.machine(device),
                "description": s.describe()}  # fmt: skip

        def write(value: dict[str, Any]) -> None:
            info["load_average_after"] = harness.machine(device)["load_average"]
            path = harness.write(f"gpu8b-{kind}-{device.type}", info | {"result": value}, out)
            print(f"[gpu_8b_explain] -> {path}", flush=True)

        return write

    if device.type == "cuda":
        torch.cuda.set_device(0)
    if args.predict:
        predict(s, device.type, save("predict"))
    if args.check:
        check(s, device, args.rounds, _found(out, device.type), save("check"))
    return out


if __name__ == "__main__":
    main()
