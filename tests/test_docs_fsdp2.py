"""docs/fsdp2.md covers all of FSDP2's API in this torch: every ``fully_shard`` argument, every
``MixedPrecisionPolicy`` field and every method ``FSDPModule`` adds to ``nn.Module`` has a row.
The page is written for torch 2.13 (exactly its API); an older torch's API is a subset."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from funcshard._runtime._compat import HAS_2_13

PAGE = Path(__file__).resolve().parent.parent / "docs" / "fsdp2.md"


def _rows(heading: str) -> set[str]:
    """The names in the first column of the table under ``## heading`` (``name(args)`` -> name)."""
    section = PAGE.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split(" | ")[0]
            names |= {re.sub(r"\(.*", "", n) for n in re.findall(r"`([^`]+)`", first)}
    return names


def _covers(documented: set[str], actual: set[str]) -> None:
    assert documented == actual if HAS_2_13 else actual <= documented


def test_every_fully_shard_argument_has_a_row():
    _covers(_rows("`fully_shard` arguments"), set(inspect.signature(fully_shard).parameters))


def test_every_mixed_precision_field_has_a_row():
    fields = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
    assert fields <= _rows("`MixedPrecisionPolicy` and `OffloadPolicy`")


def test_every_fsdp_module_method_has_a_row():
    methods = {m for m in dir(FSDPModule) if not m.startswith("_") and m not in dir(nn.Module)}
    _covers(_rows("`FSDPModule` methods"), methods)
