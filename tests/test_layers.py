"""The package's dependency rule (docs/architecture.md, "Dependency rule"), held by code: every
module of dora_jax is placed in one layer, and imports (at module level or inside a function,
``import x`` or ``from x import y``, relative ones resolved) only from its own layer and the
layers :data:`MAY_IMPORT` allows it; the jax-free layers import no jax, ``kernels`` nothing but
jax and numpy, and nothing imports the test oracles. The doc shows the same table (checked)."""

import ast
import fnmatch
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module files -> layer (paths under dora_jax/; the first pattern that matches places a module)
PLACES = (
    ("__init__.py", "base"),
    ("config/*", "base"),
    ("faults.py", "base"),
    ("platform.py", "base"),
    ("user_code.py", "base"),
    ("worker_process.py", "base"),
    ("kernels/*", "kernels"),
    ("sharding.py", "sharding"),
    ("mesh.py", "sharding"),
    ("model/tokenizer.py", "tokenizer"),
    ("model/*", "model"),
    ("rollout/*", "rollout"),
    ("train/*", "train"),
    ("data/*", "data"),
    ("envs/*", "envs"),
    ("orchestrator/*", "orchestrator"),
    ("checkpoint.py", "checkpoint"),
    ("resume.py", "checkpoint"),
    ("state_codec.py", "checkpoint"),
    ("run_dir.py", "checkpoint"),
    ("metrics.py", "report"),
    ("curves.py", "report"),
    ("report.py", "report"),
    ("health_marks.py", "report"),
    ("wandb_log.py", "report"),
    ("sim/*", "sim"),
    ("execution/*", "execution"),
    ("distributed/*", "distributed"),
    ("pipeline/*", "pipeline"),
    ("main.py", "pipeline"),
)

# layer -> the other layers it may import (a layer always imports itself)
MAY_IMPORT = {
    layer: tuple(allowed.split())
    for layer, allowed in {
        "base": "",
        "kernels": "",
        "sharding": "base",
        "tokenizer": "base",
        "model": "base sharding",
        "rollout": "base kernels sharding model",
        "train": "base sharding model",
        "data": "base",
        "envs": "base tokenizer",
        "orchestrator": "base",
        "checkpoint": "base",
        "report": "base orchestrator",
        "sim": "base orchestrator report",
        "execution": "base sharding model rollout train orchestrator checkpoint",
        "distributed": "base sharding model rollout train orchestrator checkpoint execution",
        "pipeline": "base kernels sharding tokenizer model rollout train data envs orchestrator "
        "checkpoint report execution distributed",
    }.items()
}

JAX = {"jax", "jaxlib", "flax", "optax", "orbax", "chex"}
NO_JAX = {"base", "tokenizer", "data", "envs", "orchestrator", "report", "sim"}
ONLY_THIRD_PARTY = {"kernels": {"jax", "numpy"}}
ORACLES = {"torch", "transformers"}  # test oracles: never imported by the package


def layer_of(path: str) -> str | None:
    rel = path.removeprefix("dora_jax/")
    return next((layer for pattern, layer in PLACES if fnmatch.fnmatch(rel, pattern)), None)


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: str, source: str, modules: set[str]) -> list[str]:
    """What ``path`` imports, anywhere in it: ``from p import m`` of a module ``p.m`` is ``p.m``,
    other ``from p import name`` is ``p``; relative imports resolved against ``path``'s package."""
    package = module_name(path)
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if sub in modules else base)
    return names


def violations(sources: dict[str, str], paths: list[str] | None = None) -> list[str]:
    """Every break of the rule by the modules ``paths`` (default: all) of ``sources`` (path under
    the repository -> text), one line each naming the module, its layer, the import and the
    import's layer."""
    modules = {module_name(p): p for p in sources}
    found = []
    for path in sorted(sources) if paths is None else paths:
        source, layer = sources[path], layer_of(path)
        if layer is None:
            found.append(f"{path}: placed in no layer (PLACES here, the doc's table)")
            continue
        for name in imported_names(path, source, set(modules)):
            top = name.split(".")[0]
            if top == "dora_jax":
                if name not in modules:
                    found.append(f"{path} imports {name}: no module of the package")
                    continue
                other = layer_of(modules[name])
                if other != layer and other not in MAY_IMPORT[layer]:
                    found.append(f"{path} ({layer}) imports {name} ({other})")
            elif top in sys.stdlib_module_names:
                continue
            elif top in ORACLES:
                found.append(f"{path} ({layer}) imports {name}: a test oracle")
            elif layer in NO_JAX and top in JAX:
                found.append(f"{path} ({layer}, no jax) imports {name}")
            elif layer in ONLY_THIRD_PARTY and top not in ONLY_THIRD_PARTY[layer]:
                found.append(f"{path} ({layer}) imports {name}: not in {ONLY_THIRD_PARTY[layer]}")
    return found


@functools.cache
def package_sources() -> dict[str, str]:
    files = sorted((ROOT / "dora_jax").rglob("*.py"))
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in files}


def test_the_package_keeps_the_dependency_rule():
    sources = package_sources()
    assert len(sources) > 100, "the walk found too few modules"
    assert violations(sources) == []


PLANTED = [
    # (module, source, what the report must name)
    ("dora_jax/checkpoint.py", "from dora_jax.pipeline.grpo import x\n", "dora_jax.pipeline.grpo"),
    ("dora_jax/checkpoint.py", "def f():\n    from .pipeline import grpo\n", "pipeline.grpo"),
    ("dora_jax/checkpoint.py", "import dora_jax.execution.backend\n", "execution.backend"),
    ("dora_jax/execution/group.py", "from ..distributed import remote\n", "distributed.remote"),
    ("dora_jax/distributed/host.py", "from dora_jax.pipeline import experiment\n", "experiment"),
    ("dora_jax/rollout/engine.py", "def f():\n    import dora_jax.train.step\n", "train.step"),
    ("dora_jax/train/step.py", "from dora_jax.rollout import Engine\n", "dora_jax.rollout"),
    ("dora_jax/model/layers.py", "from ..mesh import x\nfrom ..kernels import y\n", "kernels"),
    ("dora_jax/kernels/kv_cache_ops.py", "import scipy.special\n", "scipy.special"),
    ("dora_jax/orchestrator/planner.py", "def f():\n    import jax.numpy\n", "jax.numpy"),
    ("dora_jax/sim/backend.py", "from flax import nnx\n", "flax"),
    ("dora_jax/data/scoring.py", "from dora_jax.model import forward\n", "dora_jax.model"),
    ("dora_jax/envs/pool.py", "import dora_jax.model.params\n", "dora_jax.model.params"),
    ("dora_jax/train/losses.py", "import torch\n", "torch"),
    ("dora_jax/config/schema.py", "from dora_jax import faults\nimport dora_jax.gone\n", "gone"),
]


@pytest.mark.parametrize("path,source,named", PLANTED)
def test_a_planted_import_is_reported_naming_module_and_import(path, source, named):
    real = package_sources()
    assert violations(real, [path]) == []
    found = violations(real | {path: real[path] + source}, [path])
    assert len(found) == 1 and found[0].startswith(path) and named in found[0], found


def test_a_module_in_no_layer_is_reported():
    found = violations(package_sources() | {"dora_jax/gadget.py": "import os\n"})
    assert found == ["dora_jax/gadget.py: placed in no layer (PLACES here, the doc's table)"]


def test_the_allowed_imports_name_layers_and_no_cycle():
    layers = set(MAY_IMPORT)
    assert {layer for _, layer in PLACES} == layers
    assert all(set(v) <= layers - {k} for k, v in MAY_IMPORT.items())
    done: list[str] = []
    while len(done) < len(layers):  # peel off layers whose imports are all placed already
        ready = [k for k in layers - set(done) if set(MAY_IMPORT[k]) <= set(done)]
        assert ready, f"a cycle among {sorted(layers - set(done))}"
        done += ready


def _ticked(cell: str) -> list[str]:
    return sorted(re.findall(r"`([^`]+)`", cell))


def test_the_doc_shows_the_same_table():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Dependency rule", 1)[1].split("\n## ", 1)[0]
    shown = {}
    for row in section.splitlines():
        if row.startswith("| `"):
            layer, places, may, third = (c.strip() for c in row.strip().strip("|").split("|"))
            shown[_ticked(layer)[0]] = (_ticked(places), _ticked(may), third == "no jax")
    places: dict[str, list[str]] = {}
    for pattern, layer in PLACES:
        places.setdefault(layer, []).append(pattern.removesuffix("*"))
    assert {k: v[0] for k, v in shown.items()} == {k: sorted(v) for k, v in places.items()}
    assert {k: v[1] for k, v in shown.items()} == {k: sorted(v) for k, v in MAY_IMPORT.items()}
    assert {k for k, v in shown.items() if v[2]} == NO_JAX


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """The import cycles among the modules of ``sources``: each strongly connected set of two
    or more modules of the import graph, sorted. Every import counts, at module level, inside a
    function or under ``TYPE_CHECKING``; a module importing a package it lies in does not (the
    package is initialised first)."""
    modules = {module_name(p): p for p in sources}
    graph = {
        m: {
            n
            for n in imported_names(p, sources[p], set(modules))
            if n in modules and n != m and not m.startswith(n + ".")
        }
        for m, p in modules.items()
    }
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(found)


# Cycles not yet taken apart; the list may only shrink.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle_but_the_known_ones():
    assert import_cycles(package_sources()) == KNOWN_CYCLES


def test_a_planted_cycle_is_found():
    real = package_sources()
    lazy = "\n\ndef f():\n    from dora_jax.pipeline import experiment\n"
    planted = real | {"dora_jax/checkpoint.py": real["dora_jax/checkpoint.py"] + lazy}
    cycles = import_cycles(planted)
    assert len(cycles) == len(KNOWN_CYCLES) + 1
    (new,) = [c for c in cycles if c not in KNOWN_CYCLES]
    assert {"dora_jax.checkpoint", "dora_jax.pipeline.experiment"} <= set(new)


def borrowed_privates(sources: dict[str, str]) -> list[str]:
    """Classes of the package that extend a class of another module whose methods read private
    attributes (``self._x``) it neither sets nor defines: a mixin working on its subclass's
    state. One line each: the class, the base and the attributes."""
    bases: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    trees = {p: ast.parse(s, p) for p, s in sources.items()}
    for p, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, []).append((p, node))
    found = []
    for p, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for b in node.bases:
                name = b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)
                for where, base in bases.get(name, []):
                    if where == p:
                        continue
                    own, read = set(), set()
                    for n in ast.walk(base):
                        if isinstance(n, ast.FunctionDef):
                            own.add(n.name)
                        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                            if n.value.id == "self" and re.fullmatch(r"_[a-z]\w*", n.attr):
                                (own if isinstance(n.ctx, ast.Store) else read).add(n.attr)
                    if read - own:
                        found.append(f"{p}: {node.name}({name} of {where}) {sorted(read - own)}")
    return found


def test_no_class_extends_a_base_that_reads_its_private_state():
    assert borrowed_privates(package_sources()) == []


def test_a_planted_mixin_is_found():
    real = package_sources()
    planted = real | {
        "dora_jax/orchestrator/gadget_parts.py": "class Parts:\n    def f(self):\n"
        "        return self._items\n",
        "dora_jax/orchestrator/gadget.py": "from dora_jax.orchestrator.gadget_parts import Parts\n"
        "\n\nclass Gadget(Parts):\n    def __init__(self):\n        self._items = []\n",
    }
    found = borrowed_privates(planted)
    assert len(found) == 1 and "Gadget(Parts of dora_jax/orchestrator/gadget_parts.py)" in found[0]
    assert "_items" in found[0]
