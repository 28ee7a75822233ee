"""The package's layers: each module imports only from its own layer and those below it, at the
top of the module or inside a function alike, and no two modules import each other.

The order, lowest first (see ``funcshard/_runtime/__init__.py``): runtime, trees,
communication, the transforms, plans, execution; then ``optim``, ``checkpoint`` and ``testing``
(which do not import each other), pricing (``fs.explain``, ``fs.autoplan``), and the package's
public modules. Read from the sources (``ast``), so a new module or import is checked too."""

from __future__ import annotations

import ast
import pathlib

import funcshard

ROOT = pathlib.Path(funcshard.__file__).parent
RANK = {
    "_runtime": 0,
    "_trees": 1,
    "_communication": 2,
    "transforms": 3,
    "_plans": 4,
    "_execution": 5,
    "optim": 6,
    "checkpoint": 6,
    "testing": 6,
    "_pricing": 7,
}
PUBLIC = 8  # funcshard/__init__.py, explain.py, policy.py: what users import


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("funcshard", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK):
        return RANK[parts[1]], parts[1]
    return PUBLIC, "funcshard"


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str) -> set[str]:
    """The funcshard modules ``module`` imports anywhere in its code (not for type checking)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if _type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("funcshard"):
            source = node.module
        else:
            continue
        for alias in node.names:
            target = f"{source}.{alias.name}"
            found.add(target if target in MODULES else source)
    found.discard(module)
    return found


def test_every_private_module_sits_in_a_layer():
    flat = sorted(m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in RANK)
    assert flat == ["funcshard.explain", "funcshard.policy"], (
        f"modules outside the layers: {flat}; put a private module in the layer folder whose "
        "modules it imports (see funcshard/_runtime/__init__.py)"
    )


def test_each_layer_imports_only_those_below_it():
    wrong = []
    for module in sorted(MODULES):
        rank, layer = _layer(module)
        for target in sorted(_imports(module)):
            target_rank, target_layer = _layer(target)
            above = target_rank > rank
            sibling = target_rank == rank and target_layer != layer
            if above or sibling:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_two_modules_import_each_other():
    graph = {m: _imports(m) for m in MODULES}
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if t.startswith(m + "."):
                continue  # a package importing its own modules
            if state.get(t) == 1:
                cycles.append(" -> ".join([*path[path.index(t) :], t]))
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles (one of them may hide in a function):\n" + "\n".join(cycles)


def test_the_checks_see_a_wrong_import():
    """The checks read what they should: a known downward import is found, and an upward one
    would be reported (so the tests above can fail)."""
    assert "funcshard._runtime._mode" in _imports("funcshard._communication._collectives")
    assert _layer("funcshard._communication._collectives") > _layer("funcshard._runtime._mode")
    assert _layer("funcshard._execution._schedule") > _layer("funcshard.transforms._unshard")
