"""README.md's quick start runs as written, under torchrun, and prints what the README shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start() -> tuple[str, str, str]:
    """The quick start's python block, its command and the output the README shows."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    section = section[: section.index("\n## ", 1)]
    blocks = dict(re.findall(r"^```(python|bash|text)\n(.*?)^```$", section, re.M | re.S))
    return blocks["python"], blocks["bash"].strip(), blocks["text"]


def test_quick_start_runs_as_written(tmp_path):
    source, command, shown = _quick_start()
    launch = "--standalone --nproc-per-node 2 quickstart.py"
    assert command == f"OMP_NUM_THREADS=1 .venv/bin/torchrun {launch}"
    (tmp_path / "quickstart.py").write_text(source)
    torchrun = [sys.executable, "-m", "torch.distributed.run", *launch.split()]  # = its torchrun
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(torchrun, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    number = re.compile(r"\d+\.\d+")  # the losses: equal to the printed digits, give or take
    assert number.sub("L", run.stdout) == number.sub("L", shown)  # one unit (another CPU)
    for got, want in zip(number.findall(run.stdout), number.findall(shown), strict=True):
        assert abs(float(got) - float(want)) <= 1e-4, (got, want)
