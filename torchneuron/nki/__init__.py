"""NKI kernels on the `neuron` device: AWS's Neuron Kernel Interface (`nki.jit`, `nki.language` as nl, `nki.isa`
as nisa) interpreted over torch tensors, with Trainium's rules checked, engine numerics, and a modelled per-engine
timeline per call (docs/nki.md).

`import nki` works without AWS's package: torchneuron's autoload registers `NkiAlias`, a meta-path finder that
serves `nki`, `nki.language` and `nki.isa` from this package only when no other `nki` is importable, so an
installed AWS `nki` always wins. This module imports nothing heavy until a name is used."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

_LAZY = {
    "jit": ("kernel", "jit"), "simulate": ("kernel", "simulate"), "Kernel": ("kernel", "Kernel"),
    "nki_op": ("torch_op", "nki_op"), "KernelProfile": ("cost", "KernelProfile"),
}
_SUBMODULES = ("language", "isa", "core", "cost", "kernel", "ops", "torch_op")
_ALIASED = {"nki": "torchneuron.nki", "nki.language": "torchneuron.nki.language", "nki.isa": "torchneuron.nki.isa"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NkiAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `nki` (and `nki.language`, `nki.isa`) from torchneuron.nki when nothing else provides `nki`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _ALIASED:
            return None
        if fullname == "nki":
            if importlib.machinery.PathFinder.find_spec("nki") is not None:
                return None  # AWS's nki (or any other) is installed: it wins
        elif sys.modules.get("nki") is not sys.modules.get(__name__):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        # The import system returns whatever sys.modules holds under the name after exec_module.
        sys.modules[module.__name__] = importlib.import_module(_ALIASED[module.__name__])


def install_alias() -> None:
    """Register the `nki` finder (idempotent); called by torchneuron's autoload."""
    if not any(isinstance(f, NkiAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, NkiAlias())
