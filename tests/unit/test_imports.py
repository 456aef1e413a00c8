"""The package's layers: every import runs down the order of LAYERS (or stays within its own layer),
the groups of LAYERS import each other in one direction only (no circles), and the parts that must
start without torch (config, the planner, the model specs, the checkpoint manifest, the CLI's front)
import no torch. Imports inside functions count; imports under `if TYPE_CHECKING:` (annotations only)
do not."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "zerodp"

# Bottom first. A module belongs to the longest prefix listed; a package's __init__ docstring says the
# same. The few modules listed apart from their package sit lower than it: pure helpers others share.
LAYERS = [
    ["zerodp.errors"],
    ["zerodp.distributed", "zerodp.checkpoint.manifest", "zerodp.checkpoint.safe_output",
     "zerodp.telemetry.grad_noise"],  # runtime; the torch-free storage primitives; the noise-scale math
    ["zerodp.models"],  # specs (torch-free) and modules
    ["zerodp.config", "zerodp.strategies.catalog"],  # the schema (reads model specs and Hugging Face config.json
    # files); the strategies' catalog, which validation, the planner and the registry read
    ["zerodp.data", "zerodp.optim", "zerodp.convert", "zerodp.planner", "zerodp.resilience"],
    ["zerodp.telemetry", "zerodp.checkpoint"],  # measurement; training's save/load (reshards through convert)
    ["zerodp.strategies"],
    ["zerodp.trainer"],
    ["zerodp.api", "zerodp.cli", "zerodp.__main__", "zerodp"],  # entry points
]
TORCH_FREE = ["zerodp.config", "zerodp.config.sources", "zerodp.planner", "zerodp.planner.cli", "zerodp.models.arch",
              "zerodp.models.hf", "zerodp.checkpoint.manifest", "zerodp.checkpoint.safe_output", "zerodp.cli",
              "zerodp.data.prepare", "zerodp.data.prepare_chat", "zerodp.telemetry.grad_noise",
              "zerodp.optim.schedules", "zerodp.strategies.catalog", "zerodp.models.chunking"]


def group_of(module: str) -> str:
    """The LAYERS entry a module belongs to: its longest listed prefix."""
    best = max((g for layer in LAYERS for g in layer if module == g or module.startswith(g + ".")), key=len,
               default=None)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best


def layer_of(module: str) -> int:
    group = group_of(module)
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def _imports(tree: ast.AST, annotations: bool = False):
    """The modules `tree` imports; those under `if TYPE_CHECKING:` only with `annotations`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING" and not annotations:
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "zerodp":  # `from zerodp import x`: the submodule x, or the package's own name
                yield from (f"zerodp.{a.name}" if (ROOT / a.name).exists() or (ROOT / f"{a.name}.py").exists()
                            else "zerodp" for a in node.names)
            else:
                yield node.module


@functools.cache
def module_imports(annotations: bool = False) -> dict[str, set[str]]:
    """Every zerodp module -> the zerodp modules it imports (with `annotations`, those under TYPE_CHECKING too);
    parsed once per session (callers only read it)."""
    graph: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        module = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {t for t in _imports(ast.parse(f.read_text()), annotations)
                         if t == "zerodp" or t.startswith("zerodp.")}
    return graph


def import_graph() -> dict[str, set[str]]:
    """The LAYERS groups' graph: group -> the other groups it imports."""
    graph: dict[str, set[str]] = {}
    for module, targets in module_imports().items():
        src = group_of(module)
        for target in targets:
            dst = group_of(target)
            if dst != src and dst != "zerodp":  # `from zerodp import __version__`: the root's constant
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


def test_every_import_runs_down_the_layers():
    graph = module_imports()
    assert "zerodp.trainer.loop" in graph and "zerodp.checkpoint.store" in graph  # the walk saw the packages
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})" for m, targets in sorted(graph.items())
              for t in sorted(targets) if t != "zerodp" and layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_the_layer_check_finds_an_upward_import():
    assert layer_of("zerodp.config") < layer_of("zerodp.trainer.loop")
    assert layer_of("zerodp.checkpoint.manifest") < layer_of("zerodp.convert.cli") < layer_of("zerodp.checkpoint.store")


def test_every_package_says_its_layer():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Layer" in doc, f"{init} does not say which layers it may import"


def test_at_most_four_modules_at_the_top():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "errors.py"], top


def test_no_import_circles():
    graph = import_graph()
    assert "zerodp.convert" in graph and "zerodp.checkpoint" in graph  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_import_circles_among_the_planners_modules():
    """The planner's modules import each other one way: the types (zerodp.planner.types) below the formula
    modules (activations, lora, traffic, persistence), those below memory.py, which composes them; imports
    inside functions and those made for annotations only (TYPE_CHECKING) count too."""
    planner = {m: {t for t in targets if t.startswith("zerodp.planner.")}
               for m, targets in module_imports(annotations=True).items() if m.startswith("zerodp.planner.")}
    assert "zerodp.planner.memory" in planner  # the walk saw the package
    for formula in ("activations", "lora", "traffic", "persistence"):
        assert "zerodp.planner.memory" not in planner[f"zerodp.planner.{formula}"], formula
    cycle = find_cycle(planner)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_the_torch_free_parts_import_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) +
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'numpy')"
            " and m.split('.')[0] != 'numpy')\nassert not bad, bad\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_section_defaults_are_model_configs():
    """zerodp.models.arch reads old checkpoints' model sections with ModelConfig's own defaults."""
    import dataclasses

    from zerodp.config import ModelConfig
    from zerodp.models.arch import SECTION_DEFAULTS

    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ModelConfig)}
    assert {k: defaults[k] for k in SECTION_DEFAULTS} == SECTION_DEFAULTS
