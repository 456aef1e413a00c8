"""The package's import graph has no circles: module groups (a package such as zerodp.convert counts as
one) import each other in one direction only. Imports inside functions count; imports under
`if TYPE_CHECKING:` (annotations only) do not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "zerodp"


def _group(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _imports(tree: ast.AST):
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        module = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        src = _group(module)
        for target in _imports(ast.parse(f.read_text())):
            dst = _group(target)
            if target.startswith("zerodp.") and dst not in (src, "zerodp"):
                graph.setdefault(src, set()).add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_import_circles():
    graph = import_graph()
    assert "zerodp.convert" in graph and "zerodp.checkpoint" in graph  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_section_defaults_are_model_configs():
    """zerodp.models.arch reads old checkpoints' model sections with ModelConfig's own defaults."""
    import dataclasses

    from zerodp.config import ModelConfig
    from zerodp.models.arch import SECTION_DEFAULTS

    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ModelConfig)}
    assert {k: defaults[k] for k in SECTION_DEFAULTS} == SECTION_DEFAULTS
