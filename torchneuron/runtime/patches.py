"""The patch registry: every change torchneuron makes to torch or another library, at import or on demand.

Each change is one `Patch` (what it changes, why, how it is applied and undone, the test that covers it), declared
next to the code it installs (device, compiler, integrations) and applied only through `apply`. A patch replaces
attributes and mapping items through the `Applied` record it is handed, so `undo` puts the original objects back;
what is not an attribute (a thread flag, sys.meta_path, the torch-function mode stack) has its own `undo`, and a
patch nothing can undo says why. `torchneuron info` lists the active ones. Below device: imports nothing.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_MISSING = object()  # the attribute was inherited (or the key absent): undo deletes it again


@dataclass(frozen=True)
class Patch:
    name: str  # unique, kebab-case
    target: str  # what it changes, e.g. "torch.nn.Module.to"
    why: str  # one line
    test: str  # pytest node id (tests/file.py::test_name) of the test that covers it
    apply: Callable[[Applied], None]
    undo: Callable[[], None] | None = None  # what the Applied record does not restore itself
    no_undo: str = ""  # why the patch cannot be undone (then `undo` raises this)
    when: str = "import"  # "import" (autoload), "compat" (CUDA compatibility mode), "on demand" (for one call) or
    # "first use" (when the feature it serves first runs, then kept)


class Applied:
    """An active patch: the originals it replaced, in order, so that `undo` restores them in reverse."""

    def __init__(self, patch: Patch):
        self.patch, self.originals = patch, []

    def replace(self, owner: Any, attr: str, value: Any) -> None:
        """owner.attr = value, remembering the object it had in its own __dict__ (not an inherited one)."""
        self.originals.append((owner, attr, vars(owner).get(attr, _MISSING), False))
        setattr(owner, attr, value)

    def replace_code(self, func: Callable, code: Any) -> None:
        """func.__code__ = code: references to `func` taken before (e.g. by a wrapper built earlier) run it too."""
        self.originals.append((func, "__code__", func.__code__, False))
        func.__code__ = code

    def replace_item(self, mapping: MutableMapping, key: Any, value: Any) -> None:
        self.originals.append((mapping, key, mapping.get(key, _MISSING), True))
        mapping[key] = value

    def restore(self) -> None:
        while self.originals:
            owner, key, original, item = self.originals.pop()
            if item:
                owner.pop(key, None) if original is _MISSING else owner.__setitem__(key, original)
            elif original is _MISSING:
                delattr(owner, key)
            else:
                setattr(owner, key, original)


REGISTRY: dict[str, Patch] = {}
_ACTIVE: dict[str, Applied] = {}


def register(patch: Patch) -> Patch:
    """Declare a patch (at import of the module that owns it); a name is declared once."""
    if patch.name in REGISTRY and REGISTRY[patch.name] is not patch:
        raise ValueError(f"patch {patch.name!r} is declared twice ({REGISTRY[patch.name].target}, {patch.target})")
    if patch.no_undo and patch.undo is not None:
        raise ValueError(f"patch {patch.name!r} has an undo and says it has none ({patch.no_undo})")
    REGISTRY[patch.name] = patch
    return patch


def declare(name: str, target: str, why: str, test: str, apply: Callable[[Applied], None], **rest: Any) -> Patch:
    """register(Patch(...)): how an owner module declares each of its patches, at its import."""
    return register(Patch(name, target, why, test, apply, **rest))


def apply(patch: Patch | str) -> Applied:
    """Apply once (idempotent); a patch that fails half-way is rolled back and the error raised."""
    p = REGISTRY[patch] if isinstance(patch, str) else register(patch)
    if p.name in _ACTIVE:
        return _ACTIVE[p.name]
    done = _ACTIVE[p.name] = Applied(p)
    try:
        p.apply(done)
    except BaseException:
        del _ACTIVE[p.name]
        done.restore()
        raise
    return done


def undo(patch: Patch | str) -> None:
    """Put back what the patch changed (nothing if it is not active)."""
    p = REGISTRY[patch if isinstance(patch, str) else patch.name]
    if p.no_undo:
        raise RuntimeError(f"patch {p.name!r} ({p.target}) cannot be undone: {p.no_undo}")
    done = _ACTIVE.pop(p.name, None)
    if done is None:
        return
    done.restore()
    if p.undo is not None:
        p.undo()


def applied(patch: Patch | str) -> Applied:
    """The record of an active patch, for replacements it makes later (e.g. when a patched library is imported)."""
    name = patch if isinstance(patch, str) else patch.name
    if name not in _ACTIVE:
        raise RuntimeError(f"patch {name!r} is not active")
    return _ACTIVE[name]


def is_active(patch: Patch | str) -> bool:
    return (patch if isinstance(patch, str) else patch.name) in _ACTIVE


def active() -> list[Patch]:
    """The patches in effect, in the order they were applied."""
    return [a.patch for a in _ACTIVE.values()]


@contextlib.contextmanager
def swapped(owner: Any, attr: str, value: Any) -> Iterator[None]:
    """owner.attr = value for the duration of one call (a patch's own body), restored however it ends."""
    original = vars(owner).get(attr, _MISSING)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        delattr(owner, attr) if original is _MISSING else setattr(owner, attr, original)


class _RunThen:
    """A module's own loader, then `after(module)` once the module has executed."""

    def __init__(self, loader: Any, after: Callable[[ModuleType], None]):
        self.loader, self.after = loader, after

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.after(module)


class ImportHook:
    """Patch modules of other libraries when they are first imported, without importing them now (`import torch`
    stays fast): a sys.meta_path finder that answers only for the named modules, by asking the other finders and
    wrapping their loader. A module already imported is patched at `install`."""

    def __init__(self, on_load: dict[str, Callable[[ModuleType], None]]):
        self.on_load = on_load

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        after = self.on_load.get(name)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RunThen(spec.loader, after)
                return spec
        return None

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        for name, after in self.on_load.items():
            if name in sys.modules:
                after(sys.modules[name])

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
