"""The main job, examples/train_lm.py: it learns, and it resumes exactly.

The smoke run goes through ``torchrun`` as ``make train`` does; the rest calls the example's
``main(argv)`` on the session's rank pools, inside their process groups.
"""

from __future__ import annotations

import collections
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_flags():
    cfg = train_lm.parse(["--smoke", "--steps", "7", "--bf16"])
    assert cfg.steps == 7 and cfg.bf16 and cfg.width == train_lm.SMOKE["width"]
    assert train_lm.parse([]) == train_lm.Config()
    with pytest.raises(ValueError, match="--resume needs --ckpt-dir"):
        train_lm.main(["--resume"])


def test_smoke_run_learns_under_torchrun():
    """`--smoke` as CI runs it: 2 ranks under torchrun; it fails unless the held-out loss falls
    below the entropy of the bytes (checked again here from its summary line)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(EXAMPLE), "--smoke"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = re.search(
        r"held-out loss ([\d.]+) at step 0 -> ([\d.]+) at step 100 "
        r"\(uniform: ([\d.]+); entropy of the bytes: ([\d.]+)\)",
        run.stdout,
    )
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


def test_bf16_parameters_follow_fp32(world2):
    """--bf16: bf16 parameters in forward and backward, fp32 reduction and master weights; the
    losses follow the fp32 run's to bf16 precision."""
    fp32, bf16 = (world2.run(train_lm.main, [*TINY, *flag])[0] for flag in ([], ["--bf16"]))
    assert all(p.dtype == torch.float32 for p in bf16.params.values())
    torch.testing.assert_close(bf16.losses, fp32.losses, rtol=0, atol=0.01)
    assert bf16.losses != fp32.losses  # the forward did run in bf16
