"""The GPU main job, examples/train_llama.py, run tiny on the CPU: it learns, resumes exactly,
refuses ``--cuda-graph`` without CUDA, and answers ``--help`` before importing torch.

The training runs call the example's ``main(argv)`` on the session's 2-rank gloo pool; the
command-line checks start the script as a user does.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"
sys.path.insert(0, str(EXAMPLE.parent))
import train_llama  # noqa: E402

TINY = ["--device", "cpu", "--width", "32", "--heads", "2", "--depth", "2", "--context", "32",
        "--batch", "8", "--warmup", "3", "--lr", "3e-3", "--data-mb", "0.1"]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE.parent.parent)}


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, str(EXAMPLE), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_tiny_run_learns(world2):
    """30 steps on 2 ranks: every loss finite, the same on both ranks (averaged), and the last
    steps well below the first (and below the uniform guess over the bytes)."""
    first, second = world2.run(train_llama.main, [*TINY, "--steps", "30"])
    assert first["losses"] == second["losses"] and first["step"] == second["step"] == 30
    losses = first["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    vocab = len(train_llama.load_text(0.1).vocab)
    assert losses[0] > math.log(vocab) - 0.5  # an untrained model guesses about uniformly
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


def test_recompute_computes_the_same_steps(world2):
    """``--recompute`` recomputes activations in the backward: the same losses to rounding."""
    plain = world2.run(train_llama.main, [*TINY, "--steps", "4"])[0]["losses"]
    again = world2.run(train_llama.main, [*TINY, "--steps", "4", "--recompute"])[0]["losses"]
    assert again == pytest.approx(plain, rel=1e-5)


@pytest.mark.inductor
def test_compile_follows_the_eager_steps(world2):
    """``--compile`` (``fs.jit``: traced once, compiled by inductor): the eager losses to 1e-5."""
    plain = world2.run(train_llama.main, [*TINY, "--steps", "4"])[0]["losses"]
    compiled = world2.run(train_llama.main, [*TINY, "--steps", "4", "--compile"])[0]["losses"]
    assert compiled == pytest.approx(plain, rel=1e-5)


def test_bf16_follows_fp32(world2):
    """``--bf16`` (bf16 compute, fp32 reduction and master weights): the losses of 6 steps
    follow fp32's to bf16's precision, and are not fp32's exactly (bf16 was used)."""
    plain = world2.run(train_llama.main, [*TINY, "--steps", "6"])[0]["losses"]
    bf16 = world2.run(train_llama.main, [*TINY, "--steps", "6", "--bf16"])[0]["losses"]
    assert bf16 == pytest.approx(plain, abs=0.05) and bf16 != plain


def test_resume_continues_exactly(world2, tmp_path):
    """Saving every 2 steps, stopped after step 5 as if killed, resumed from step 4's checkpoint
    to step 8: the resumed steps' losses equal those of an uninterrupted 8-step run bit for
    bit. A folder that holds a run is refused without ``--resume``, and ``--resume`` with other
    options (here another width: other shapes) is refused, naming them."""
    whole = world2.run(train_llama.main, [*TINY, "--steps", "8"])[0]["losses"]
    ckpt = ["--ckpt-dir", str(tmp_path / "run"), "--save-every", "2"]
    part = world2.run(train_llama.main, [*TINY, *ckpt, "--steps", "8", "--stop-at", "5"])[0]
    assert part["step"] == 5 and part["losses"] == whole[:5]
    rest = world2.run(train_llama.main, [*TINY, *ckpt, "--steps", "8", "--resume"])[0]
    assert rest["step"] == 8 and rest["losses"] == whole[4:]
    with pytest.raises(Exception, match=r"holds a run .*step_000008.*: add --resume"):
        world2.run(train_llama.main, [*TINY, *ckpt, "--steps", "8"])
    with pytest.raises(Exception, match=r'was trained with .*"width": 32.*resume with those'):
        world2.run(train_llama.main, [*TINY, *ckpt, "--steps", "8", "--width", "64", "--resume"])


def test_cuda_graph_is_refused_on_the_cpu(world2):
    """``--cuda-graph --device cpu``: one usage error before any rank starts; ``--cuda-graph``
    on a machine without CUDA (the device defaulted): refused on every rank, naming the fix."""
    run = _script(*TINY, "--steps", "4", "--cuda-graph")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1] == f"train_llama.py: error: {train_llama.CPU_GRAPH}"
    if train_llama.torch.cuda.is_available():
        return
    at = TINY.index("--device")
    auto = TINY[:at] + TINY[at + 2 :]
    with pytest.raises(Exception, match=r"--cuda-graph needs --device cuda .*not available"):
        world2.run(train_llama.main, [*auto, "--steps", "4", "--cuda-graph"])


def test_help_and_the_script_on_two_ranks(tmp_path):
    """``--help`` lists the flags; the script started as a user does (2 ranks through torchrun's
    launcher) trains and prints its summary with tokens/s and MFU ("-" on the CPU); a run the
    ranks refuse is one message and exit status 2, without a traceback."""
    command = [sys.executable, "-X", "importtime", str(EXAMPLE), "--help"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, env=ENV)
    assert run.returncode == 0 and not re.search(r"\| +torch\b", run.stderr)
    for flag in ("--width", "--cuda-graph", "--compile", "--recompute", "--resume", "--bf16",
                 "--peak-tflops"):  # fmt: skip
        assert flag in run.stdout
    run = _script(*TINY, "--steps", "5", "--ranks", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "2 ranks on cpu" in out and "5 steps in" in out and "tok/s, MFU -" in out
    run = _script(*TINY, "--steps", "5", "--ckpt-dir", str(tmp_path), "--resume")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    refused = f"train_llama.py: error: --resume: --ckpt-dir {tmp_path} holds no checkpoint"
    assert refused in run.stderr
