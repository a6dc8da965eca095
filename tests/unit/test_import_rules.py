"""The import rules of docs/architecture.md, checked on the code itself.

Every `import` and `from ... import` in src/fleetrl counts, wherever it stands (module level,
inside a function, under TYPE_CHECKING): a lazy import is still an arrow between two rooms.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "fleetrl"

# Leaves: the vocabulary and helpers everything may use; they use nothing of fleetrl but leaves.
LEAVES = {"fleetrl.versions", "fleetrl.contract", "fleetrl.admin_signature", "fleetrl.files", "fleetrl.errors",
          "fleetrl.failpoints", "fleetrl.progress", "fleetrl.cores", "fleetrl.torchrun", "fleetrl.lora",
          "fleetrl.tripwire", "fleetrl.transports", "fleetrl.provider_capabilities",
          "fleetrl.strict", "fleetrl.heavy_imports"}
# (importer prefix, imported prefix, why it is forbidden)
FORBIDDEN = [
    ("fleetrl.engine", "fleetrl.orchestrator", "worker-process code knows nothing of the orchestrator"),
    ("fleetrl.engine", "fleetrl.trainer", "worker-process code knows nothing of the trainer"),
    ("fleetrl.engine", "fleetrl.inference", "worker-process code talks to the coordinator only over the wire"),
    ("fleetrl.inference", "fleetrl.engine", "the coordinator reaches workers through the contract, not their code"),
    ("fleetrl.inference", "fleetrl.weights", "transports plug in through the provider seam's protocol"),
    ("fleetrl.inference", "fleetrl.orchestrator", "the fleet serves any caller; the orchestrator is one"),
    ("fleetrl.inference", "fleetrl.trainer", "the fleet receives weights through a transport, not from the trainer"),
    ("fleetrl.weights", "fleetrl.engine", "the sender runs in the trainer, which has no vLLM"),
    ("fleetrl.weights", "fleetrl.trainer", "a transport sends any named tensors"),
    ("fleetrl.weights", "fleetrl.orchestrator", "a transport sends any named tensors"),
    ("fleetrl.orchestrator", "fleetrl.engine", "the orchestrator reaches workers through the fleet"),
    ("fleetrl.orchestrator", "fleetrl.trainer", "the orchestrator hands batches over as files"),
    ("fleetrl.orchestrator", "fleetrl.weights", "publishing is the training loop's, through the fleet"),
    ("fleetrl.trainer", "fleetrl.engine", "the trainer publishes through a hook the composition root fills"),
    ("fleetrl.trainer", "fleetrl.inference", "the trainer publishes through a hook the composition root fills"),
    ("fleetrl.trainer", "fleetrl.weights", "the trainer publishes through a hook the composition root fills"),
    ("fleetrl.trainer", "fleetrl.orchestrator", "the trainer reads batches as files"),
]
# What the engine (inside workers) may use of weights/: the receiving side and the formats both
# sides share, by module name; never a sender, the factory or the fanout, which run in the trainer.
ENGINE_USES_OF_WEIGHTS = {"receiver", "wire", "group", "buckets", "checksum", "manifest"}
# The composition root: only the CLI (and the root itself) imports it.
ROOT, ROOT_IMPORTERS = "fleetrl.app", {"fleetrl.cli"}
# The config package: its section schemas and the loader that assembles them into one Config.
CONFIG, CONFIG_LOADER = "fleetrl.config", "fleetrl.config.loader"
# The fleet coordinator's parts, lowest first: each imports only those before it, and the rest
# of fleetrl imports only the package itself (`Fleet` and the fence's records).
FLEET_LAYERS = ["fleetrl.inference.fleet.roster", "fleetrl.inference.fleet.fence", "fleetrl.inference.fleet.lifecycle",
                "fleetrl.inference.fleet.routing", "fleetrl.inference.fleet"]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


@functools.cache  # every test walks the same files: each is parsed once
def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported fleetrl module, line, at module level) for every import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import submodule` is an arrow to the submodule.
            names = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for name in names:
            if name == "fleetrl" or name.startswith("fleetrl."):
                found.append((name, node.lineno, id(node) in top_level))
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        edges.setdefault(module_name(path), set()).update(
            name for name, _, _ in imports_of(path) if name != module_name(path))
    return edges


def test_the_walk_sees_the_package():
    edges = graph()
    assert "fleetrl.inference.fleet" in edges and "fleetrl.versions" in edges["fleetrl.batch"]


@pytest.mark.parametrize("importer, imported, why", FORBIDDEN)
def test_no_forbidden_arrow(importer, imported, why):
    bad = [
        f"{path.relative_to(SRC)}:{line} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py")) if module_name(path).startswith(importer)
        for name, line, _ in imports_of(path) if name == imported or name.startswith(imported + ".")
    ]
    assert not bad, f"{importer} must not import {imported} ({why}): " + "; ".join(bad)


def test_only_the_cli_imports_the_composition_root():
    bad = [f"{importer} imports {name}" for importer, names in graph().items() for name in names
           if (name == ROOT or name.startswith(ROOT + "."))
           and importer not in ROOT_IMPORTERS and not importer.startswith(ROOT)]
    assert not bad, f"only {sorted(ROOT_IMPORTERS)} may import {ROOT}: " + "; ".join(bad)


def test_leaves_import_only_leaves():
    bad = [f"{leaf} imports {name}" for leaf in LEAVES for name in graph().get(leaf, ()) if name not in LEAVES]
    assert all(leaf in graph() for leaf in LEAVES)
    assert not bad, "; ".join(bad)


def test_the_config_imports_only_leaves_and_the_loader_no_section():
    """Every layer reads the config, so it reads none of them; a section's schema is whole without
    the loader, which is the one module that knows every section."""
    edges = graph()
    package = [name for name in edges if name == CONFIG or name.startswith(CONFIG + ".")]
    assert CONFIG_LOADER in package
    bad = [f"{module} imports {name}" for module in package for name in edges[module]
           if name not in LEAVES and not name.startswith(CONFIG + ".")]
    bad += [f"{module} imports {name}" for module in package if module not in (CONFIG, CONFIG_LOADER)
            for name in edges[module] if name == CONFIG_LOADER]
    assert not bad, "; ".join(bad)


def test_the_fleets_parts_import_only_the_parts_below_them():
    edges = graph()
    package = FLEET_LAYERS[-1]
    assert sorted(name for name in edges if name.startswith(package + ".")) == sorted(FLEET_LAYERS[:-1])
    bad = [f"{module} imports {name}" for at, module in enumerate(FLEET_LAYERS) for name in edges[module]
           if name in FLEET_LAYERS[at:]]
    bad += [f"{importer} imports {name}" for importer, names in edges.items() if not importer.startswith(package)
            for name in names if name.startswith(package + ".")]
    assert not bad, "; ".join(bad)


def test_the_engine_uses_only_the_receiving_side_of_weights():
    bad = [
        f"{path.relative_to(SRC)}:{line} imports {name}"
        for path in sorted((PACKAGE / "engine").rglob("*.py"))
        for name, line, _ in imports_of(path)
        if name.startswith("fleetrl.weights") and name.rpartition(".")[2] not in ENGINE_USES_OF_WEIGHTS
    ]
    assert not bad, f"fleetrl.engine may import only {sorted(ENGINE_USES_OF_WEIGHTS)} of fleetrl.weights: " + \
        "; ".join(bad)


def test_receivers_reach_no_coordinator_code():
    """Not even through another module: a worker rank runs them, and has no coordinator."""
    edges = graph()
    receivers = sorted(module_name(path) for path in (PACKAGE / "weights").rglob("receiver.py"))
    assert receivers, "no weights/*/receiver.py found"
    for receiver in receivers:
        reached, todo = set(), [receiver]
        while todo:
            for name in edges.get(todo.pop(), ()):
                if name not in reached:
                    reached.add(name)
                    todo.append(name)
        bad = sorted(name for name in reached if name.startswith("fleetrl.inference"))
        assert not bad, f"{receiver} reaches {bad}"


def test_weights_never_import_vllm_at_module_level():
    # The trainer process sends weights and has no vLLM to import.
    for path in sorted((PACKAGE / "weights").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "vllm" or n.startswith("vllm.") for n in names), \
                f"{path.relative_to(SRC)}:{node.lineno} imports vLLM at module level"


def test_no_import_cycle():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
