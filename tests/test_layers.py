"""The import graph of torchneuron (and torch_neuronx) follows the documented layers: nothing imports upward,
peers of the middle layer import each other only along ALLOWED, so no cycle joins two packages; and inside one
package no module imports, directly or through others, a module that imports it back. Every import statement
counts, found with ast (relative and absolute): at module level, inside functions (a deferred import still closes
a cycle), and under `if TYPE_CHECKING:` (the types still depend on each other). `from pkg import name` is an edge
to the module pkg.name when that is a module, else to pkg (its __init__); a package's implicit import of its
parent __init__ is not an edge."""
from __future__ import annotations

import ast
import graphlib
import itertools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Bottom to top. A component is a subpackage of torchneuron, one of its top-level modules, or torch_neuronx;
# each is placed here explicitly. `_C`, the C++ core, is part of runtime; `torchneuron` is the package itself
# (autoload: it registers the device, the c10d backend, the compiler's route, compat mode and the integrations).
LAYERS = (
    {"_version", "hardware"},
    {"runtime"},
    {"device"},
    {"compiler", "distributed", "costmodel", "profiler", "migrate", "integrations", "models", "nki"},
    {"torchneuron"},
    {"torch_neuronx", "cli", "demo"},  # AWS's name layer, the command line, the demo
)
# Imports between peers of one layer, each with why (acyclic).
ALLOWED = {
    ("profiler", "costmodel"): "the profiler prices what ran with the cost model",
    ("compiler", "profiler"): "a compiled kernel under torch.profiler is recorded by the profiler's kineto bridge",
    ("profiler", "nki"): "the profiler records NKI kernel calls with their own modelled timeline",
    ("integrations", "nki"): "the porting report lists the NKI kernels called, with their modelled cost",
    ("integrations", "compiler"): "the porting report lists eager fusion's compile work and the groups left unfused",
}
RANK = {c: i for i, layer in enumerate(LAYERS) for c in layer}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _component(module: str) -> str:
    if module == "torchneuron._C":
        return "runtime"
    parts = module.split(".")
    return parts[0] if parts[0] == "torch_neuronx" or len(parts) == 1 else parts[1]


def import_edges() -> list[tuple[str, str, str]]:
    """(importer, imported module, "file:line") for every import of our modules."""
    files = [p for d in ("torchneuron", "torch_neuronx") for p in (REPO / d).rglob("*.py")]
    modules = {_module_name(p) for p in files} | {"torchneuron._C"}
    edges = []
    for path in files:
        me = _module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            edges += [(me, t, where) for t in targets if t.split(".")[0] in ("torchneuron", "torch_neuronx")]
    return edges


def test_every_component_is_placed():
    components = {_component(m) for e in import_edges() for m in e[:2]}
    components |= {_component(_module_name(p)) for p in (REPO / "torchneuron").glob("*.py")}
    components |= {p.name for p in (REPO / "torchneuron").iterdir() if (p / "__init__.py").exists()}
    assert components <= RANK.keys(), f"place these in LAYERS: {sorted(components - RANK.keys())}"


def test_allowed_peer_edges_are_acyclic_and_within_a_layer():
    graphlib.TopologicalSorter({a: {b} for a, b in ALLOWED}).prepare()  # CycleError on a cycle
    assert all(RANK[a] == RANK[b] for a, b in ALLOWED)


def test_no_upward_or_unlisted_peer_import():
    bad, used = [], set()
    for me, target, where in import_edges():
        a, b = _component(me), _component(target)
        if a == b or RANK[b] < RANK[a]:
            continue
        if RANK[a] == RANK[b] and (a, b) in ALLOWED:
            used.add((a, b))
            continue
        bad.append(f"{where}: {me} -> {target} ({a} -> {b}: {'upward' if RANK[b] > RANK[a] else 'peer'})")
    assert not bad, "\n".join(bad)
    assert used == ALLOWED.keys(), f"ALLOWED lists edges nobody uses: {sorted(ALLOWED.keys() - used)}"


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for me, target, _ in import_edges():
        if _component(me) != _component(target):
            graph.setdefault(_component(me), set()).add(_component(target))
    graphlib.TopologicalSorter(graph).prepare()


def test_no_cycle_inside_a_package():
    """Modules of one component (compiler, migrate, nki, ...) import each other without a cycle: each cycle found
    is listed, module by module, with the import statements that close it."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for me, target, at in import_edges():
        if me != target and _component(me) == _component(target):
            graph.setdefault(me, set()).add(target)
            where.setdefault((me, target), at)
    cycles = []
    while True:
        try:
            graphlib.TopologicalSorter(graph).prepare()
            break
        except graphlib.CycleError as e:
            cycle = e.args[1][::-1]  # [a, b, ..., a]: each module imports the next
            cycles.append(" -> ".join(cycle) + ": " + ", ".join(where[m, n] for m, n in itertools.pairwise(cycle)))
            graph[cycle[0]].discard(cycle[1])  # report this cycle once, then look for the next
    assert not cycles, "import cycles inside a package:\n" + "\n".join(cycles)
