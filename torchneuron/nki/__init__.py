"""NKI kernels on the `neuron` device: AWS's Neuron Kernel Interface (`nki.jit`, `nki.language` as nl, `nki.isa`
as nisa) interpreted over torch tensors, with Trainium's rules checked, engine numerics, and a modelled per-engine
timeline per call (docs/nki.md).

`import nki` works without AWS's package: torchneuron's autoload registers `NkiAlias`, a meta-path finder that
serves `nki`, `nki.language` and `nki.isa` (and the earlier `neuronxcc.nki` names) from this package only when
no other `nki` (`neuronxcc`) is importable, so an installed AWS package always wins. This module imports nothing
heavy until a name is used."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

_LAZY = {
    "jit": ("kernel", "jit"), "baremetal": ("kernel", "jit"), "trace": ("kernel", "jit"),
    "simulate": ("kernel", "simulate"),
    "Kernel": ("kernel", "Kernel"), "simulate_kernel": ("kernel", "simulate_kernel"),
    "benchmark": ("kernel", "benchmark"), "profile": ("kernel", "profile"), "tensor": ("core", "NkiTensor"),
    "nki_op": ("torch_op", "nki_op"), "KernelProfile": ("cost", "KernelProfile"),
    "dtype": ("language", "DType"),  # the type of dtypes (annotations such as `output_dtype: nki.dtype`)
}
_SUBMODULES = ("language", "isa", "core", "cost", "kernel", "ops", "torch_op", "typing", "validation", "compiler")
# `nki` is AWS's current package; `neuronxcc.nki` the earlier one inside the compiler wheel (its kernels use the
# legacy forms this implementation also accepts). "" = an empty parent package.
_ALIASED = {"nki": "torchneuron.nki", "nki.language": "torchneuron.nki.language", "nki.isa": "torchneuron.nki.isa",
            "nki.typing": "torchneuron.nki.typing", "neuronxcc": "", "neuronxcc.nki": "torchneuron.nki",
            "neuronxcc.nki.language": "torchneuron.nki.language", "neuronxcc.nki.isa": "torchneuron.nki.isa",
            "neuronxcc.nki.typing": "torchneuron.nki.typing", "nki.compiler": "torchneuron.nki.compiler",
            "neuronxcc.nki.compiler": "torchneuron.nki.compiler",
            # the isa enums (oob_mode, dge_mode, matmul_perf_mode, ...) under the module path AWS's nki-library and
            # AWS's own doc tests import them from
            "nki.isa.constants": "torchneuron.nki.isa", "neuronxcc.nki.isa.constants": "torchneuron.nki.isa"}
_ROOTS = ("nki", "neuronxcc")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NkiAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `nki` (and `nki.language`, `nki.isa`, and `neuronxcc.nki...`) from torchneuron.nki when nothing else
    provides the top-level name."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _ALIASED:
            return None
        if fullname in _ROOTS:
            if importlib.machinery.PathFinder.find_spec(fullname) is not None:
                return None  # AWS's package (or any other of that name) is installed: it wins
        elif not getattr(sys.modules.get(fullname.split(".")[0]), "_torchneuron_alias", False) and \
                sys.modules.get(fullname.split(".")[0]) is not sys.modules.get(__name__):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        """The aliased module itself (None: a new, empty parent package)."""
        return importlib.import_module(_ALIASED[spec.name]) if _ALIASED[spec.name] else None

    def exec_module(self, module: Any) -> None:
        if not _ALIASED.get(module.__spec__.name):
            module._torchneuron_alias = True
            return
        # the import system set the alias's spec on our module: give it back its own
        module.__spec__ = importlib.machinery.PathFinder.find_spec(module.__name__, _parent_path(module.__name__))


def _parent_path(name: str) -> Any:
    parent = name.rpartition(".")[0]
    return sys.modules[parent].__path__ if parent else None


_FINDER = NkiAlias()


def _install(done: Any) -> None:
    sys.meta_path.insert(0, _FINDER)


def _uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in _ALIASED:  # forget the aliases, so `import nki` finds whatever is installed again
        module = sys.modules.get(name)
        if module is not None and (getattr(module, "_torchneuron_alias", False)
                                   or module.__name__.startswith("torchneuron.")):
            sys.modules.pop(name)


def install_alias() -> None:
    """Register the `nki` finder (idempotent); called by torchneuron's autoload."""
    from ..runtime import patches

    patches.apply(patches.REGISTRY.get(ALIAS_PATCH) or patches.declare(
        ALIAS_PATCH, "sys.meta_path (an import hook serving nki, nki.language, nki.isa and neuronxcc.nki...)",
        "`import nki` reaches torchneuron's NKI when AWS's nki (neuronxcc) is not installed; an installed one wins",
        "tests/test_nki.py::test_nki_alias_patch_is_undone_and_redone", _install, undo=_uninstall))


ALIAS_PATCH = "nki-import-alias"
