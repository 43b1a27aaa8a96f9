"""The patch registry (torchneuron.runtime.patches): every change to torch or another library is one entry with a
test that exists, undo puts the original objects back, and nothing in torchneuron patches torch outside it."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from conftest import run_py

import torchneuron
from torchneuron.runtime import patches

ROOT = Path(torchneuron.__file__).parents[1]
REGISTRY_FILE = ROOT / "torchneuron" / "runtime" / "patches.py"


def _all_declared() -> dict[str, patches.Patch]:
    import torchneuron.integrations.cuda_compat  # noqa: F401  (declares the compat-mode patches without applying them)

    return patches.REGISTRY


def _defined_tests(path: Path) -> set[str]:
    """pytest node ids (without parameters) of the test functions and methods a file defines."""
    tree, out = ast.parse(path.read_text()), set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            out |= {f"{node.name}::{f.name}" for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")}
    return out


def test_every_patch_is_described_and_names_a_test_that_exists():
    declared = _all_declared()
    assert len(declared) >= 15, sorted(declared)
    for p in declared.values():
        assert p.target and p.why and "\n" not in p.why and p.when in ("import", "compat", "on demand",
                                                                            "first use"), p
        assert p.no_undo or p.undo is not None or p.apply is not None, p
        path, _, name = p.test.partition("::")
        assert (ROOT / path).is_file(), (p.name, p.test)
        assert name.split("[")[0] in _defined_tests(ROOT / path), f"{p.name}: {p.test} is not a test"


def _current(owner, key, item: bool):
    if key == "__code__":  # Applied.replace_code: a function's code, not an entry of its __dict__
        return owner.__code__
    return owner.get(key, patches._MISSING) if item else vars(owner).get(key, patches._MISSING)


def test_undo_restores_the_originals_and_apply_puts_the_patch_back():
    import sys

    undoable = [p for p in patches.active() if not p.no_undo]
    assert {"print-without-dtype-events", "refuse-sharing-neuron-memory",
            "route-default-backend", "backward-on-calling-thread", "lightning-accelerator"} <= {
        p.name for p in undoable}
    for p in undoable:
        replaced = list(patches.applied(p).originals)
        patched = [_current(o, k, item) for o, k, _, item in replaced]
        patches.undo(p)
        try:
            assert not patches.is_active(p)
            for (owner, key, original, item), new in zip(replaced, patched, strict=True):
                assert _current(owner, key, item) is original is not new, (p.name, key)
            if p.name == "backward-on-calling-thread":
                assert torch._C._is_multithreading_enabled()
            if p.name == "lightning-accelerator":
                from torchneuron.integrations import _HOOK
                assert _HOOK not in sys.meta_path
        finally:
            patches.apply(p)
        assert [_current(o, k, item) is not orig for o, k, orig, item in patches.applied(p).originals] == [True] * len(
            replaced), p.name
    assert not torch._C._is_multithreading_enabled()
    for p in [p for p in _all_declared().values() if p.when == "on demand"]:  # applied for one call: none active
        assert not patches.is_active(p)
        done = patches.apply(p)
        replaced = [(o, k, orig, item) for o, k, orig, item in done.originals]
        assert replaced and all(_current(o, k, item) is not orig for o, k, orig, item in replaced), p.name
        patches.undo(p)
        assert all(_current(o, k, item) is orig for o, k, orig, item in replaced), p.name
    m = torch.nn.Linear(2, 2)
    w = m.weight
    assert m.to("neuron").weight is w and m.cpu().weight is w  # the re-applied conversion patch works


def test_patches_without_an_undo_say_why():
    for p in [p for p in _all_declared().values() if p.no_undo]:
        with pytest.raises(RuntimeError, match="cannot be undone"):
            patches.undo(p)
        assert patches.is_active(p)


def test_compat_mode_is_undone_and_redone():
    """In a fresh process: compat mode's patches replace the originals, disable() puts every one back (the mode
    stack included), and enable() works again."""
    run_py("""
        import torch, torch.nn as nn
        from torchneuron.integrations import cuda_compat as compat
        from torchneuron.runtime import patches
        def now():
            return {"Module.to": nn.Module.to, "Module.cuda": vars(nn.Module)["cuda"],
                    "is_available": torch.cuda.is_available, "Generator": torch.Generator,
                    "range_push": torch.cuda.nvtx.range_push,
                    "Backend.__new__": vars(torch.distributed.Backend)["__new__"]}
        originals = now()
        depth = torch._C._len_torch_function_stack()
        compat.enable()
        assert compat.is_enabled() and torch._C._len_torch_function_stack() == depth + 1
        patched = now()
        assert [k for k, v in originals.items() if patched[k] is v] == []
        replaced = [r for p in compat.COMPAT for r in patches.applied(p).originals]
        assert len(replaced) > 60, len(replaced)
        compat.disable()
        assert not compat.is_enabled() and torch._C._len_torch_function_stack() == depth
        restored = now()
        assert [k for k, v in originals.items() if restored[k] is not v] == []
        current = lambda o, k, item: o.get(k, patches._MISSING) if item else vars(o).get(k, patches._MISSING)
        assert [k for o, k, orig, item in replaced if current(o, k, item) is not orig] == []
        assert torch.zeros(1, device="cpu").device.type == "cpu" and not torch.cuda.is_available()
        compat.enable()
        assert torch.zeros(1, device="cuda").device.type == "neuron"
        assert {p.name for p in patches.active()} >= {p.name for p in compat.COMPAT}
    """, env={"PYTHONWARNINGS": "ignore"})


# ---- nothing patches torch (or another library) outside the registry -------------------------------------------

_MUTATORS = {"register", "insert", "append", "remove", "pop", "update", "clear", "__setitem__", "setdefault"}


def _patch_sites(path: Path) -> list[str]:
    """Attribute/item assignments, deletions, setattr/delattr and mutating calls whose object is reached from an
    imported name that is not torchneuron's own (torch.*, multiprocessing, sys.meta_path, lightning modules...),
    directly or through a local name bound from one (`Module = torch.nn.Module`, `for hop in (rng_prims.x,)`)."""
    tree = ast.parse(path.read_text())
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("torchneuron")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("torchneuron"):
            foreign |= {a.asname or a.name for a in node.names}
    foreign -= {"annotations", "Any", "Callable", "dataclass", "field", "NamedTuple", "TypeVar"}

    def root(e: ast.expr) -> str | None:
        """The name an attribute/item chain starts from (None through a call: a new object, not a library's)."""
        while isinstance(e, (ast.Attribute, ast.Subscript)):
            e = e.value
        return e.id if isinstance(e, ast.Name) else None

    changed = True
    while changed:  # local names bound to foreign objects (assignments and loop targets)
        changed = False
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.For):
                pairs = [(node.target, node.iter)]
            for target, value in pairs:
                values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
                src = {root(v) for v in values} & foreign
                names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if src else set()
                if isinstance(target, (ast.Name, ast.Tuple)) and names - foreign:
                    foreign |= names
                    changed = True
    # the apply and undo functions of registry entries may call a library's registration API (sys.meta_path.insert,
    # a cache's clear); they still replace attributes only through their Applied record
    declared = {a.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "declare" for a in [*node.args[4:5], *(k.value for k in node.keywords
                                                                              if k.arg in ("apply", "undo"))]
                if isinstance(a, ast.Name)}
    inside = {n.lineno for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in declared
              for n in ast.walk(f) if hasattr(n, "lineno")}
    sites = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in [e for x in targets for e in (x.elts if isinstance(x, ast.Tuple) else [x])]:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in foreign:
                sites.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and root(node.args[0]) in foreign:
                sites.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(f, ast.Attribute) and f.attr in _MUTATORS and root(f) in foreign
                  and isinstance(f.value, ast.Attribute) and node.lineno not in inside):
                sites.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return sites


# Changes that are not patches of a library, each looked at: (file, the start of the flagged text).
_NOT_PATCHES = {
    ("script.py", "sys.argv"),  # `torchneuron run` / `profile` run a script as `python script.py` does
    ("script.py", "sys.path"),
    # a child forked mid-compile: a fresh lock in place of Dynamo's, held by the parent's compiler thread it does
    # not have, and Inductor's settings back to their values outside the compile's `config.patch`
    ("eager_fusion.py", "sys.modules['torch._dynamo.convert_frame'].compile_lock"),
    ("eager_fusion.py", "setattr(sys.modules['torch._inductor.config'], name, value)"),
    ("config.py", "os.environ"),  # environment writes (scoped_env, default_env): the configuration's own concern
}


def test_nothing_patches_outside_the_registry():
    files = [*(ROOT / "torchneuron").rglob("*.py"), *(ROOT / "torch_neuronx").rglob("*.py")]
    found = [s for f in files if f != REGISTRY_FILE for s in _patch_sites(f)]
    found = [s for s in found if not any(s.startswith(f"{file}:") and s.split(": ", 1)[1].startswith(text)
                                         for file, text in _NOT_PATCHES)]
    assert found == [], "patch torch and other libraries through torchneuron.runtime.patches:\n" + "\n".join(found)


def test_the_scan_sees_a_patch(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("import torch\nimport torch._tensor_str as ts\nfrom multiprocessing.reduction import ForkingPickler\n"
                 "import sys\nModule = torch.nn.Module\n"
                 "def go(x):\n    Module.to = x\n    ts._str = x\n    setattr(torch.nn.Module, 'cpu', x)\n"
                 "    ForkingPickler._extra_reducers[int] = x\n    sys.meta_path.insert(0, x)\n"
                 "    for hop in (torch.ops.aten,):\n        hop.py_kernels[1] = x\n    y = object()\n    y.a = 1\n"
                 "    from torch._inductor import codecache\n    codecache.write, y.b = x, x\n")
    assert sorted(s.split(": ", 1)[1].split("(")[0] for s in _patch_sites(f)) == sorted([
        "Module.to", "ts._str", "setattr", "ForkingPickler._extra_reducers[int]", "sys.meta_path.insert",
        "hop.py_kernels[1]", "codecache.write"])


def test_info_lists_the_active_patches(capsys):
    from torchneuron.cli import main

    assert main(["info", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["patches"]
    assert [p["name"] for p in listed] == [p.name for p in patches.active()]
    assert {"refuse-sharing-neuron-memory", "route-default-backend"} <= {p["name"] for p in listed}
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "torch._tensor_str._str" in text and f"{len(listed)} active" in text
