"""docs/failures.md documents every error and warning funcshard raises.

How the check works: every ``raise X(...)`` and ``warnings.warn(...)`` in ``funcshard/**/*.py``
is found with ``ast``. The literal text of its message (the constant parts of the string or
f-string, between the placeholders) is cut into phrases of four consecutive words (punctuation
and backticks ignored). The page must have a table row, in the section of the site's area
(``AREAS``: by file, or by ``file::function``), that names the exception type (or the
warning's category) and contains one of those phrases. So a new error fails here until a row
quotes some of its message, while rewording a message fails only if none of the phrases the
page quotes survive.

Messages built elsewhere (``raise ValueError(_message(...))``, ``raise _error(...)``) are listed
in ``INDIRECT`` with the phrases to look for; re-raises (``raise``, ``raise error``) are skipped.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "funcshard"
PAGE = ROOT / "docs" / "failures.md"
WORDS = 4  # phrase length

SHARDING = "Sharding and meshes"
TREES = "Trees, and ranks that disagree"
GRADIENTS = "Gradients and frozen parameters"
MODULES = "Modules: extract and functional_call"
SCHEDULE = "Plans and the schedule"
TORCH_FUNC = "torch.func transforms"
OPTIM = "Optimizers: fs.optim"
CHECKPOINT = "Checkpoints: fs.checkpoint"
INIT = "Initialisation: fs.materialize"
TESTING = "The testing harness: fs.testing"
COMPILE = "Compiling: fs.jit and torch.compile"
CUDA_GRAPH = "CUDA graphs: fs.cuda_graph"
EXPLAIN_CLI = "Explaining a step: fs.explain, python -m funcshard.explain"
LOW_PRECISION = "Low-precision weights: tensor subclasses"

# The page section of each raise site: "file::function" first, then the file, then its folder.
AREAS = {
    "_trees/_spec.py": SHARDING,
    "_trees/_spec.py::from_local": TORCH_FUNC,
    "_trees/_dtensor.py": TORCH_FUNC,
    "_trees/_spec.py::check_materialized": INIT,
    "transforms/_shard.py": SHARDING,
    "_trees/_parallel.py": SHARDING,
    "_communication/_consensus.py": TREES,
    "_communication/_store.py": TREES,
    "_communication/_hangs.py": TREES,
    "_communication/_peers.py": TREES,
    "_communication/_debug.py": TREES,
    "_trees/_tree.py": TREES,
    "_execution/_autodiff.py": GRADIENTS,
    "transforms/_unshard.py": GRADIENTS,
    "transforms/_reduce.py": GRADIENTS,
    "_communication/_counts.py": GRADIENTS,
    "_communication/_grad_layout.py": GRADIENTS,
    "_trees/_extract.py": MODULES,
    "_trees/_meta.py": MODULES,
    "_trees/_deferred.py": MODULES,
    "_trees/_activation_checkpoint.py": MODULES,
    "_plans/_grouping.py": SCHEDULE,
    "_plans/_plan.py": SCHEDULE,
    "_plans/_plan_meshes.py": SCHEDULE,
    "_runtime/_compile.py": COMPILE,
    "_runtime/_compat.py": COMPILE,
    "_execution/_cuda_graph.py": CUDA_GRAPH,
    "_execution/_host.py": CUDA_GRAPH,
    "_execution/_jit.py": COMPILE,
    "_execution/_jit_trace.py": COMPILE,
    "_pricing/_explain.py": EXPLAIN_CLI,
    "_pricing/_autoplan.py": EXPLAIN_CLI,
    "_pricing/_explain_plot.py": EXPLAIN_CLI,
    "_pricing/_explain_cli.py": EXPLAIN_CLI,
    "_communication/_post_forward.py": SCHEDULE,
    "_pricing/_explain_scale.py": EXPLAIN_CLI,
    "_pricing/_fake_world.py": EXPLAIN_CLI,
    "_plans/_bucketing.py": SCHEDULE,
    "_plans/_record.py": SCHEDULE,
    "_execution/_schedule.py": SCHEDULE,
    "_execution/_recompute.py": SCHEDULE,
    "_trees/_activation_checkpoint.py::name_failures": SCHEDULE,  # the plan's recompute
    "_communication/_collectives.py": TORCH_FUNC,
    "_runtime/_mode.py": TORCH_FUNC,  # refuse_jacfwd
    "_communication/_flat.py": TORCH_FUNC,
    "_communication/_packed.py": LOW_PRECISION,
    "_trees/_subclass.py": LOW_PRECISION,
    "transforms/_materialize.py": INIT,
    "_trees/_materialize_steps.py": INIT,
    "optim/": OPTIM,
    "checkpoint/": CHECKPOINT,
    "testing/": TESTING,
}

# Sites whose message is not written at the raise: "file::qualified function" -> (type, phrases).
INDIRECT = {
    "_pricing/_autoplan.py::autoplan": (
        "ValueError",
        ["no plan fits memory_budget"],
    ),  # nothing_fits()
    "_pricing/_autoplan.py::_Search.run": ("ValueError", ["no plan fits memory_budget"]),
    "_trees/_dtensor.py::locals_of": ("NotImplementedError", ["transforms over DTensor trees"]),
    "_runtime/_compile.py::refuse_while_tracing": (
        "RuntimeError",
        ["was created inside a function"],
    ),
    "_communication/_consensus.py::_agree": (
        "ValueError",
        [
            "ranks disagree",
            "raised on every rank",
            "the ranks run different optimizers",
            "different numbers of optimizer updates",
            "optimizer states are at different steps",
        ],
    ),
    "_plans/_plan.py::_recompute_names": ("ValueError", ["cannot recompute its forward"]),
    # "<cuda_graph: the step cannot be captured | jit: <step> cannot be traced>: <what>"
    "_execution/_host.py::HostReads._refuse": (
        "RuntimeError",
        ["reads a device value on the host", "a copy between host"],
    ),
    # the deferred error's text (_deviation.out_of_plan), warned at once
    "_execution/_schedule.py::_Run._outside": ("UserWarning", ["last run of it had passed"]),
    "_plans/_plan.py::_validate": (
        "ValueError",
        ["cannot recompute its forward"],
    ),  # _ROOT_RECOMPUTES
    "testing/_pool.py::Pool._results": ("RankError", ["failed on rank", "did not finish"]),
    "checkpoint/_comm.py::all_ok": ("RuntimeError", ["Saving wait"]),  # "rank r: <error>"
    "_execution/_autodiff.py::value_and_grad.wrapped": (
        "TypeError",
        ["inside another fs value_and_grad"],
    ),
    "checkpoint/_load.py::load": ("RuntimeError", ["is damaged key", "reading the data of"]),
    "checkpoint/_save.py::_prepare_directory": ("OSError", ["cannot create the temporary"]),
    # the OSError in a failed write's chain, raised on every rank as save_failed's message
    "checkpoint/_integrity.py::Writer.write_data": ("OSError", ["writing the checkpoint"]),
    "checkpoint/_integrity.py::Writer.finish": ("OSError", ["writing the checkpoint"]),
    "testing/_reference.py::assert_close": ("AssertionError", ["does not match the structure"]),
    # _recompute.differed
    "_execution/_recompute.py::_Call.run": (
        "RuntimeError",
        ["recomputed differently from its forward"],
    ),
    "_execution/_recompute.py::_Unkept.__torch_function__": (
        "RuntimeError",
        ["recomputed differently from its forward", "computed from its inputs and kept"],
    ),
    "_trees/_activation_checkpoint.py::name_failures.check_named": (
        "RuntimeError",
        ["recomputed differently from its forward"],
    ),
    "_trees/_activation_checkpoint.py::name_failures.recompute_named": (
        "RuntimeError",
        ["recomputed differently from its forward"],
    ),
}


class Site(NamedTuple):
    file: str  # relative to funcshard/
    line: int
    function: str  # qualified: "Class.method", "outer.inner", "" at module level
    kind: str  # the exception type or warning category
    phrases: list[str]  # "" entries: none found (the message is not a literal)

    def where(self) -> str:
        return f"funcshard/{self.file}:{self.line}"


def _runs(node: ast.AST) -> list[str]:
    """The literal pieces of a message expression, split where a value is interpolated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out, current = [], ""
        for v in node.values:
            if isinstance(v, ast.Constant):
                current += v.value
            else:
                out.append(current)
                current = ""
        return [*out, current]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _runs(node.left) + _runs(node.right)
    return []


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _phrases(message: ast.AST | None) -> list[str]:
    """Phrases of ``WORDS`` words from the message; the longest piece (of two words or more)
    if none is that long."""
    runs = [_words(r) for r in _runs(message)] if message is not None else []
    windows = [" ".join(r[i : i + WORDS]) for r in runs for i in range(len(r) - WORDS + 1)]
    if windows:
        return windows
    longest = max(runs, key=len, default=[])
    return [" ".join(longest)] if len(longest) >= 2 else []


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _site(file: str, scope: list[str], node: ast.AST) -> Site | None:
    function = ".".join(scope)
    if isinstance(node, ast.Raise):
        exc = node.exc
        if exc is None or (isinstance(exc, ast.Name) and not exc.id[0].isupper()):
            return None  # a re-raise
        if isinstance(exc, ast.Call):
            message = exc.args[0] if exc.args else None
            return Site(file, node.lineno, function, _name(exc.func), _phrases(message))
        return Site(file, node.lineno, function, _name(exc), [])
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
        category = node.args[1] if len(node.args) > 1 else None
        category = next((k.value for k in node.keywords if k.arg == "category"), category)
        kind = _name(category) if category is not None else "UserWarning"
        return Site(file, node.lineno, function, kind, _phrases(node.args[0]))
    return None


def sites() -> list[Site]:
    found = []

    def visit(file: str, node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(file, child, [*scope, child.name])
                continue
            site = _site(file, scope, child)
            if site is not None:
                found.append(site)
            visit(file, child, scope)

    for path in sorted(PACKAGE.rglob("*.py")):
        file = path.relative_to(PACKAGE).as_posix()
        visit(file, ast.parse(path.read_text()), [])
    return found


def _area(site: Site) -> str | None:
    top = site.function.split(".")[0]
    folder = site.file.rsplit("/", 1)[0] + "/" if "/" in site.file else None
    for key in (f"{site.file}::{top}", site.file, folder):
        if key in AREAS:
            return AREAS[key]
    return None


def _plain(text: str) -> str:
    """The words of ``text``, space-separated and padded (so that phrases match whole words)."""
    return f" {' '.join(_words(text))} "


def sections() -> dict[str, list[str]]:
    """``{level-2 heading: its table rows}``, each as its words (see :func:`_plain`)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].replace("`", "").strip()
            out[current] = []
        elif current is not None and line.startswith("|"):
            out[current].append(_plain(line))
    return out


def _documented(rows: list[str], kind: str, phrases: list[str]) -> bool:
    return any(f" {kind} " in row and any(f" {p} " in row for p in phrases) for row in rows)


def test_every_error_and_warning_is_on_the_page():
    rows_of = sections()
    found = sites()
    assert len(found) > 100, "the scan finds too few raise sites: is the parser broken?"
    problems = []
    for site in found:
        area = _area(site)
        if area is None:
            problems.append(f"{site.where()}: funcshard/{site.file} has no area in AREAS")
            continue
        rows = rows_of.get(area, [])
        if site.phrases:
            if not _documented(rows, site.kind, site.phrases):
                first = site.phrases[0]
                problems.append(
                    f"{site.where()}: {site.kind} {first!r}... has no row in '## {area}'"
                )
            continue
        key = f"{site.file}::{site.function}"
        if key not in INDIRECT:
            problems.append(f"{site.where()}: no literal message; add {key!r} to INDIRECT")
            continue
        kind, phrases = INDIRECT[key]
        for phrase in phrases:
            if not _documented(rows, kind, [phrase]):
                problems.append(f"{site.where()}: {kind} {phrase!r} has no row in '## {area}'")
    assert not problems, "docs/failures.md lacks:\n" + "\n".join(problems)


def test_indirect_entries_are_current():
    keys = {f"{s.file}::{s.function}" for s in sites() if not s.phrases}
    stale, missing = sorted(set(INDIRECT) - keys), sorted(keys - set(INDIRECT))
    assert not stale and not missing, f"INDIRECT: stale {stale}, missing {missing}"


def test_every_area_is_a_section_of_the_page():
    headings = set(sections())
    missing = sorted(set(AREAS.values()) - headings)
    assert not missing, f"docs/failures.md has no '## ' section for {missing}"
    assert "What funcshard does not detect" in headings


def test_the_phrases_come_from_the_message():
    """The extraction itself: literal runs between placeholders, four words at a time."""
    tree = ast.parse('raise ValueError(f"shard: {p!r} is already a DTensor with {x}; pass full")')
    (site,) = [s for node in ast.walk(tree) if (s := _site("x.py", [], node)) is not None]
    assert site.kind == "ValueError"
    assert site.phrases == ["is already a DTensor", "already a DTensor with"]
    assert _phrases(ast.parse('"no file "').body[0].value) == ["no file"]
