"""The main job, examples/train_lm.py: it learns, it resumes exactly, and it meets a user well.

The runs that go through a launcher start the script as ``make train`` does (it checks its flags
and starts torchrun's launcher itself) or under ``torchrun``; the rest calls the example's
``main(argv)`` on the session's rank pools, inside their process groups.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import funcshard as fs

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
sys.path.insert(0, str(EXAMPLE.parent))
import train_lm  # noqa: E402

# A few steps of a very small model: what resuming must reproduce, not what it learns.
TINY = ["--width", "16", "--heads", "2", "--depth", "2", "--context", "16", "--batch", "8",
        "--steps", "6", "--warmup", "2", "--data-mb", "0.1", "--eval-every", "3",
        "--eval-batches", "1", "--sample", "8"]  # fmt: skip


def _full_params(argv: list[str]) -> dict[str, torch.Tensor]:
    """On a rank: run the job, return its final parameters as full tensors."""
    return {k: v.full_tensor() for k, v in train_lm.main(argv).params.items()}


def test_text_is_the_standard_library_split_by_file():
    text = train_lm.load_text(0.1)
    again = train_lm.load_text(0.1)  # deterministic
    assert torch.equal(text.train, again.train) and text.digest == again.digest
    assert 0 < len(text.heldout) < len(text.train) and len(text.vocab) == len(set(text.vocab))
    decoded = bytes(text.vocab[i] for i in text.train[:1000])
    assert b"import" in decoded or b"def " in decoded  # Python source
    counts = collections.Counter(bytes(text.vocab[i] for i in text.train.tolist()))
    n = len(text.train)
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    assert math.isclose(text.entropy, entropy, rel_tol=1e-9)
    assert entropy < math.log(len(text.vocab))  # a bound below the uniform guess


def test_batches_are_global_and_split_evenly():
    text = train_lm.load_text(0.1)
    batch = train_lm.batch_at(text.train, 5, 8, 16, seed=0)
    assert batch.shape == (8, 17) and batch.dtype == torch.int64
    assert torch.equal(batch, train_lm.batch_at(text.train, 5, 8, 16, seed=0))
    assert not torch.equal(batch, train_lm.batch_at(text.train, 6, 8, 16, seed=0))
    for world in (1, 2, 4):  # each rank its rows; together the whole batch, in rank order
        parts = [train_lm.rows(batch, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError, match="--batch 8 is not divisible by the 3 ranks"):
        train_lm.rows(batch, 0, 3)


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE.parent.parent)}


def _script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The script as ``make train`` runs it: ``python examples/train_lm.py ARGS``."""
    command = [sys.executable, str(EXAMPLE), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_flags(capsys):
    cfg = train_lm.parse(["--smoke", "--steps", "7", "--bf16"])
    assert cfg.steps == 7 and cfg.bf16 and cfg.width == train_lm.SMOKE["width"]
    assert train_lm.parse([]) == train_lm.Config()
    bad = {
        "--resume": "--resume needs --ckpt-dir",
        "--save-every 5": "--save-every needs --ckpt-dir",
        "--heads 3": "--heads 3 must divide --width 128",
        "--steps 0 --dropout 1": "--steps 0 must be at least 1; --dropout 1.0 must be in [0, 1)",
        "--optimizer sgd": "argument --optimizer: invalid choice: 'sgd'",
        "--batch 6 --ranks 4": "--batch 6 is not divisible by the 4 ranks",
    }
    for argv, message in bad.items():
        with pytest.raises(SystemExit) as exit:
            train_lm.parse(argv.split())
        assert exit.value.code == 2 and message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):  # a run, too, checks before it starts
        train_lm.main(["--resume"])


def test_help_describes_every_flag_without_importing_torch():
    """``--help``: every flag with what it does, its default and its choices; the script
    answers before importing torch (``-X importtime`` lists every module imported)."""
    run = subprocess.run([sys.executable, "-X", "importtime", str(EXAMPLE), "--help"],
                         capture_output=True, text=True, timeout=60, env=ENV)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert not re.search(r"\| +torch\b", run.stderr), "--help imported torch"
    text = " ".join(run.stdout.split())  # argparse wraps the help
    for f in train_lm.dataclasses.fields(train_lm.Config):
        assert f"--{f.name.replace('_', '-')}" in text
        assert " ".join(f.metadata["help"].split()) in text, f.name
    assert "--optimizer {adamw,muon}" in text and "(default: 800)" in text


def test_bad_flag_is_one_error_before_any_rank_starts():
    run = subprocess.run([sys.executable, "-X", "importtime", str(EXAMPLE), "--optimizer", "sgd"],
                         capture_output=True, text=True, timeout=60, env=ENV)  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if not line.startswith("import time:")]
    assert run.returncode == 2 and run.stdout == ""
    assert len(errors) == 2 and errors[0] == "usage: train_lm.py [flags]  (every flag: --help)"
    assert errors[1].startswith("train_lm.py: error: argument --optimizer: invalid choice: 'sgd'")
    assert "adamw" in errors[1] and "muon" in errors[1]  # the choices
    assert not re.search(r"\| +torch\b", run.stderr)


def test_short_run_shortens_the_warmup(world2):
    """``--steps`` below the default warm-up: a tenth of the run warms up, and a line says so;
    the run is the one that ``--warmup`` of that length gives."""
    assert train_lm.warmup_steps(train_lm.parse(["--steps", "800"])) == (80, None)
    steps, note = train_lm.warmup_steps(train_lm.parse(["--steps", "50"]))
    assert steps == 5 and note.startswith("warm-up: 5 steps, a tenth of --steps 50")
    at = TINY.index("--warmup")
    tiny = TINY[:at] + TINY[at + 2 :]  # the default warm-up, 80 steps
    short = world2.run(train_lm.main, [*tiny, "--steps", "20"])[0]
    explicit = world2.run(train_lm.main, [*tiny, "--steps", "20", "--warmup", "2"])[0]
    assert short.losses == explicit.losses


def test_checkpoint_folder_must_fit_the_run(world2, tmp_path):
    """``--resume`` from a folder without a checkpoint is refused (it would start at step 0),
    and so is a new run into a folder that holds another run's checkpoints; the launcher
    refuses both before starting any rank."""
    empty = ["--ckpt-dir", str(tmp_path / "empty"), "--resume"]
    with pytest.raises(Exception, match=r"Refused: --resume: .*empty holds no checkpoint"):
        world2.run(train_lm.main, [*TINY, *empty])
    ckpt = ["--ckpt-dir", str(tmp_path / "run")]
    world2.run(train_lm.main, [*TINY, *ckpt, "--steps", "2"])
    with pytest.raises(Exception, match=r"Refused: --ckpt-dir .*run already holds a run's "
                       r"checkpoints \(the newest: step_000002\): add --resume"):  # fmt: skip
        world2.run(train_lm.main, [*TINY, *ckpt, "--steps", "2"])
    run = _script(*TINY, *empty, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1].startswith("train_lm.py: error: --resume: ")


def test_smoke_run_learns():
    """`--smoke` as CI runs it: 2 ranks, started as ``make train`` starts them; it fails unless
    the held-out loss falls below the entropy of the bytes (checked again here from its summary
    line)."""
    run = _script("--smoke")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = re.search(
        r"held-out loss ([\d.]+) at step 0 -> ([\d.]+) at step 100 "
        r"\(uniform: ([\d.]+); entropy of the bytes: ([\d.]+)\)",
        run.stdout,
    )
    assert "Traceback" not in run.stderr
    assert summary, run.stdout
    first, last, uniform, entropy = map(float, summary.groups())
    assert entropy < first < uniform + 0.5  # starts near the uniform guess
    assert last < entropy  # ends below any context-free model


def test_smoke_check_fails_when_the_model_has_not_learned(world2):
    with pytest.raises(Exception, match="smoke test failed: held-out loss"):
        world2.run(train_lm.main, ["--smoke", "--steps", "3", "--warmup", "1", "--sample", "0"])


def test_resume_is_bitwise_exact(world2, tmp_path):
    """N steps straight == k steps, stop, resume for N - k: parameters and every loss, bit for
    bit. Dropout makes the ranks' random generators part of what must be restored; the stop comes
    one step after the last save, so the resumed run redoes that step from the checkpoint."""
    args = [*TINY, "--dropout", "0.1"]
    straight = world2.run(train_lm.main, args)
    ckpt = ["--ckpt-dir", str(tmp_path)]
    stopped = world2.run(train_lm.main, [*args, *ckpt, "--save-every", "2", "--stop-at", "3"])
    assert [r.step for r in stopped] == [3, 3] and stopped[0].sample is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]
    resumed = world2.run(train_lm.main, [*args, *ckpt, "--resume"])
    for rank in range(2):
        assert resumed[rank].step == 6
        assert resumed[rank].losses == straight[rank].losses[2:]  # steps 3 to 6
        assert resumed[rank].heldout == straight[rank].heldout[1:]
        for k, p in straight[rank].params.items():
            assert torch.equal(resumed[rank].params[k], p), (rank, k)
    assert resumed[0].sample == straight[0].sample


def test_muon_and_ema_resume_bitwise_exact(world2, tmp_path):
    """--optimizer muon --ema: the Muon + AdamW state and the average are checkpointed, so a
    resumed run repeats the uninterrupted one bit for bit (parameters, losses, both held-out
    losses); the average is evaluated beside the weights and differs from them."""
    args = [*TINY, "--optimizer", "muon", "--ema", "0.5"]
    straight = world2.run(train_lm.main, args)
    ckpt = ["--ckpt-dir", str(tmp_path)]
    world2.run(train_lm.main, [*args, *ckpt, "--save-every", "2", "--stop-at", "3"])
    resumed = world2.run(train_lm.main, [*args, *ckpt, "--resume"])
    for rank in range(2):
        assert resumed[rank].losses == straight[rank].losses[2:]
        assert resumed[rank].heldout_ema == straight[rank].heldout_ema[1:]
        for k, p in straight[rank].params.items():
            assert torch.equal(resumed[rank].params[k], p), (rank, k)
    first = straight[0].heldout[0][1]
    weights, average = straight[0].heldout[-1][1], straight[0].heldout_ema[-1][1]
    assert average != weights and max(weights, average) < first
    adamw = world2.run(train_lm.main, TINY)[0]
    assert adamw.losses[0] == straight[0].losses[0] and adamw.losses[1:] != straight[0].losses[1:]


@pytest.mark.parametrize("world", [1, 4])
def test_resume_on_another_number_of_ranks(worlds, tmp_path, world):
    """Saved on 2 ranks, resumed on 1 or 4: the same values up to fp32 rounding (the additions
    happen in another order; see the example's [Note: exact resume])."""
    straight = worlds(2).run(_full_params, TINY)[0]
    ckpt = ["--ckpt-dir", str(tmp_path)]
    worlds(2).run(train_lm.main, [*TINY, *ckpt, "--save-every", "3", "--stop-at", "3"])
    resumed = worlds(world).run(_full_params, [*TINY, *ckpt, "--resume"])
    for params in resumed:
        torch.testing.assert_close(params, straight, rtol=1e-5, atol=1e-6)


def test_resume_refuses_another_configuration(world2, tmp_path):
    ckpt = ["--ckpt-dir", str(tmp_path)]
    world2.run(train_lm.main, [*TINY, *ckpt, "--steps", "3"])
    with pytest.raises(Exception, match=r"trained with --steps 3 \(now 6\), --width 16 \(now 32\)"):
        world2.run(train_lm.main, [*TINY, *ckpt, "--resume", "--width", "32"])
    with pytest.raises(Exception, match="--batch 7 is not divisible by the 2 ranks"):
        world2.run(train_lm.main, [*TINY, "--batch", "7"])


@pytest.mark.inductor
def test_compile_follows_the_eager_steps(world2):
    """--compile (the step traced once and compiled by inductor, fs.jit): the eager run's
    losses to 1e-5 (relative), and the same held-out losses."""
    eager = world2.run(train_lm.main, [*TINY, "--steps", "6"])[0]
    compiled = world2.run(train_lm.main, [*TINY, "--steps", "6", "--compile"])[0]
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    heldout = [h for _, h in eager.heldout]
    assert [h for _, h in compiled.heldout] == pytest.approx(heldout, rel=1e-5)


def test_bf16_parameters_follow_fp32(world2):
    """--bf16: bf16 parameters in forward and backward, fp32 reduction and master weights; the
    losses follow the fp32 run's to bf16 precision."""
    fp32, bf16 = (world2.run(train_lm.main, [*TINY, *flag])[0] for flag in ([], ["--bf16"]))
    assert all(p.dtype == torch.float32 for p in bf16.params.values())
    torch.testing.assert_close(bf16.losses, fp32.losses, rtol=0, atol=0.01)
    assert bf16.losses != fp32.losses  # the forward did run in bf16


# Runs to interrupt: long enough to be stopped mid-way, even on fast cores (a step of this model
# takes milliseconds; the first checkpoint comes after 10 of its STEPS); a checkpoint every 10.
STEPS = 200
LONG = [*TINY, "--steps", str(STEPS), "--save-every", "10", "--eval-every", "100"]


def _records(path: Path) -> dict[str, list]:
    """A --metrics file: the starts (step, restart) and the (step, loss) and (step, held-out)
    entries, in the order they were written."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    fields = {
        "start": ("start", "restart"),
        "loss": ("step", "loss"),
        "heldout": ("step", "heldout"),
    }
    return {
        kind: [tuple(r[k] for k in keys) for r in lines if kind in r]
        for kind, keys in fields.items()
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, world2) -> dict[str, list]:
    """The metrics of `LONG` run from start to end without interruption, on the session's 2
    ranks: the same arithmetic as 2 ranks that torchrun starts, so the same bits."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    ckpt, metrics = folder / "ckpt", folder / "metrics.jsonl"
    world2.run(train_lm.main, [*LONG, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)])
    return _records(metrics)


def _started(command: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """``command`` running in a session of its own (as a terminal's job is), its output going to
    a file in ``tmp_path``."""
    out = tmp_path / "output.txt"
    with open(out, "w") as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=ENV,
                                   cwd=EXAMPLE.parent.parent, start_new_session=True)  # fmt: skip
    return process, out


def _first_checkpoint(process: subprocess.Popen, folder: Path, out: Path) -> str:
    deadline = time.monotonic() + 240
    while (found := fs.checkpoint.latest(folder)) is None:
        assert process.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 240 s"
        time.sleep(0.01)
    return found


def _rank_pid(launcher: int, rank: int) -> int:
    """The process id of rank ``rank``, a child of torchrun's launcher (Linux's /proc)."""
    children = " ".join(p.read_text() for p in Path(f"/proc/{launcher}/task").glob("*/children"))
    for pid in map(int, children.split()):
        if f"RANK={rank}" in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0"):
            return pid
    raise AssertionError(f"no rank {rank} among the children of {launcher}")


def test_ctrl_c_stops_cleanly_saves_and_says_how_to_resume(tmp_path, uninterrupted):
    """Ctrl-C (SIGINT to the job's process group): the ranks stop after the same step, save it,
    end without a traceback, and rank 0 prints the step and the command that resumes; that
    command then finishes the run exactly as the uninterrupted run does."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [*LONG, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)]
    process, out = _started([sys.executable, str(EXAMPLE), *args], tmp_path)
    _first_checkpoint(process, ckpt, out)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert process.wait(timeout=120) == 128 + signal.SIGINT, out.read_text()[-3000:]
    output = out.read_text()
    assert "Traceback" not in output and "Error" not in output, output[-3000:]
    stop = re.search(rf"stopped by Ctrl-C after step (\d+) of {STEPS}; saved (\S+)\. To resume:"
                     r"\n  (.+)\n", output)  # fmt: skip
    assert stop, output[-3000:]
    step = int(stop[1])
    assert 10 <= step < STEPS and stop[2] == fs.checkpoint.latest(ckpt)
    assert stop[2].endswith(f"step_{step:06d}")
    command = shlex.split(stop[3])
    assert command[-1] == "--resume" and command[-1 - len(args) : -1] == args
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV,
                             cwd=EXAMPLE.parent.parent)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = _records(metrics)
    assert records["start"] == [(0, 0), (step, 0)]
    assert records["loss"] == uninterrupted["loss"]  # steps 1..step, then the rest
    assert records["heldout"] == uninterrupted["heldout"]


def test_ctrl_c_message(monkeypatch):
    """What rank 0 prints after Ctrl-C: without --ckpt-dir, how to be able to resume; with it,
    the command, which names the ranks when they are not the launcher's default."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = train_lm.parse(TINY)
    result = train_lm.Result({}, 3, [], [], 0, 0.0, None, [], interrupted=True)
    assert train_lm.stopped(cfg, result, TINY, 2) == (
        "stopped by Ctrl-C after step 3 of 6; nothing was saved (no --ckpt-dir): to be able to "
        "resume a run, give it --ckpt-dir DIR (and --save-every N)"
    )
    saved = result._replace(saved="runs/a/step_000003")
    message = train_lm.stopped(cfg, saved, [*TINY, "--ckpt-dir", "runs/a"], 4)
    where, command = message.split("\n  ")
    assert where == "stopped by Ctrl-C after step 3 of 6; saved runs/a/step_000003. To resume:"
    python, script, *args = shlex.split(command)
    assert Path(python).samefile(sys.executable) and Path(script).samefile(EXAMPLE)
    assert args == [*TINY, "--ckpt-dir", "runs/a", "--resume", "--ranks", "4"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks in /proc")
def test_restart_after_a_rank_dies_resumes_by_itself(tmp_path, uninterrupted):
    """Under ``torchrun --max-restarts 1``, rank 1 killed (SIGKILL) after the first checkpoint:
    torchrun restarts both ranks, they resume from the newest checkpoint without being asked,
    and the run ends as the uninterrupted one does (every loss after the restart equal to its
    loss at that step: an uninterrupted run from that checkpoint computes exactly those)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [*LONG, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "1"]  # fmt: skip
    process, out = _started([*torchrun, str(EXAMPLE), *args], tmp_path)
    _first_checkpoint(process, ckpt, out)
    os.kill(_rank_pid(process.pid, 1), signal.SIGKILL)
    assert process.wait(timeout=300) == 0, out.read_text()[-3000:]
    records = _records(metrics)
    assert [restart for _, restart in records["start"]] == [0, 1], records["start"]
    resumed_at = records["start"][1][0]
    assert resumed_at >= 10 and resumed_at % 10 == 0
    assert f"(restart 1): resuming from {ckpt}/step_{resumed_at:06d}" in out.read_text()
    first = records["loss"][: len(records["loss"]) - (STEPS - resumed_at)]
    assert first == uninterrupted["loss"][: len(first)]  # the first attempt, until rank 1 died
    assert len(first) >= resumed_at  # it got past the checkpoint it was resumed from
    after = records["loss"][len(first) :]
    assert after == uninterrupted["loss"][resumed_at:]
    assert records["heldout"][-1] == uninterrupted["heldout"][-1]


def _float8_smoke():
    pytest.importorskip("torchao")
    result = train_lm.main(["--smoke", "--float8", "--sample", "0"])  # checks that it learned
    kinds = {k: type(v.to_local()).__name__ for k, v in result.params.items()}
    return kinds, result.heldout[-1][1]


def test_float8_smoke_run_learns(world2):
    """``--float8``: the blocks' weights stay float8 training's through the run, the head and
    embeddings plain, and the held-out loss falls below the entropy (main's own check)."""
    for kinds, _ in world2.run(_float8_smoke):
        assert kinds["blocks.0.qkv.weight"] == "WeightWithDynamicFloat8CastTensor", kinds
        assert kinds["embed.weight"] == "Tensor", kinds
