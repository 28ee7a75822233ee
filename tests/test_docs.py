"""The documentation runs: every ```python block of docs/*.md, as written, on 2 gloo ranks.

A page marked with ``<!-- blocks run in the test process -->`` (testing.md) shows what users
write in a test file: its blocks run here, in the pytest process, and start ranks themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import funcshard as fs

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)")
_IN_TEST_PROCESS = "<!-- blocks run in the test process -->"


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _blocks(page: Path) -> list[str]:
    """The page's python blocks, each padded with blank lines so that its line numbers are the
    page's (tracebacks then point into the Markdown file)."""
    text = page.read_text()
    return ["\n" * text.count("\n", 0, m.start(1)) + m.group(1) for m in _BLOCK.finditer(text)]


def _params(in_test_process: bool):
    return [
        pytest.param(source, f"docs/{page.name}", id=f"{page.name}:{i}")
        for page in _pages()
        if (_IN_TEST_PROCESS in page.read_text()) == in_test_process
        for i, source in enumerate(_blocks(page), start=1)
    ]


def _exec_block(source: str, filename: str) -> bool:
    """Run one block in a fresh namespace (on a rank of an initialized process group)."""
    exec(compile(source, filename, "exec"), {"__name__": "__docs__"})
    return True


@pytest.mark.parametrize(("source", "filename"), _params(in_test_process=False))
def test_block_runs(world2, source, filename):
    assert world2.run(_exec_block, source, filename, timeout=120) == [True, True]


@pytest.mark.parametrize(("source", "filename"), _params(in_test_process=True))
def test_block_runs_in_test_process(source, filename):
    assert _exec_block(source, filename)


def test_docs_exist():
    assert (DOCS / "index.md").is_file()
    assert len(_pages()) > 1


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_page_has_a_python_block(page):
    assert _blocks(page), f"docs/{page.name} has no ```python block"


def test_index_links_every_page():
    linked = set(_LINK.findall((DOCS / "index.md").read_text()))
    pages = {p.name for p in _pages()} - {"index.md"}
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"
    assert linked <= pages | {"index.md"}, f"broken links: {sorted(linked - pages)}"


def _mentioned(name: str, text: str) -> bool:
    """``name`` as code: ``fs.name``, ``funcshard.name``, or ``policy.`` / ``testing.`` /
    ``optim.`` / ``checkpoint.`` ``name``, or in backticks."""
    prefixes = r"\bfs\.|\bfuncshard\.|\bpolicy\.|\btesting\.|\boptim\.|\bcheckpoint\.|`"
    return re.search(rf"(?:{prefixes}){re.escape(name)}\b", text) is not None


@pytest.mark.parametrize(
    "name",
    sorted(
        set(fs.__all__)
        | {f"policy.{n}" for n in fs.policy.__all__}
        | {f"testing.{n}" for n in fs.testing.__all__}
        | {f"optim.{n}" for n in fs.optim.__all__}
        | {f"checkpoint.{n}" for n in fs.checkpoint.__all__}
    ),
)
def test_public_name_is_documented(name):
    text = "\n".join(p.read_text() for p in _pages())
    short = name.split(".")[-1]
    assert _mentioned(short, text), f"{name} is not mentioned in docs/"
