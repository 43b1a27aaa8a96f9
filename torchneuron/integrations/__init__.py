"""How the training libraries find `neuron` (see docs/ecosystem.md).

- Hugging Face transformers and accelerate need no patch: they detect a native neuron device by the importable
  module `torch_neuronx` (shipped in this distribution) and then use `torch.neuron` and the "neuron" backends.
- PyTorch Lightning has no extension point, so an import hook patches it (lightning.py) right after its
  accelerator and connector modules execute. `import torch` installs the hook (a sys.meta_path entry that
  imports nothing); Lightning loads only when the user imports it. `uninstall()` removes the hook and reverts
  every patch already applied.
- CUDA scripts run unmodified under compatibility mode (cuda_compat.py: `torchneuron run`,
  TORCHNEURON_CUDA_COMPAT=1), which ends with a porting report (porting_report.py).
Every patch here is an entry of the patch registry (torchneuron.runtime.patches).
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..runtime import patches
from . import lightning as _lightning

_PATCHES = _lightning.module_patches()


def _apply(patch: Any, module: ModuleType) -> None:
    """A Lightning release whose internals moved must still import: the patch is then skipped, and said."""
    try:
        patch(module)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"torchneuron could not teach {module.__name__} about `neuron` ({type(e).__name__}: {e}); "
                      "Lightning works as without torchneuron there (docs/ecosystem.md lists the tested versions)",
                      RuntimeWarning, stacklevel=2)


_HOOK = patches.ImportHook({name: functools.partial(_apply, patch) for name, patch in _PATCHES.items()})


def _install(done: patches.Applied) -> None:
    _HOOK.install()


def _uninstall() -> None:
    _HOOK.uninstall()
    _lightning.undo()


LIGHTNING = patches.declare(
    _lightning.PATCH, "sys.meta_path (an import hook); then, in lightning / pytorch_lightning / lightning_fabric: the "
    "accelerator registries, the connectors' auto accelerator, strategy and precision choice, DDPStrategy's device ids",
    "Lightning has no extension point for an outside accelerator: accelerator='neuron' and 'auto' pick neuron",
    "tests/test_ecosystem.py::test_lightning_patch_is_undone_and_redone", _install, undo=_uninstall)


def install() -> None:
    """Patch Lightning when it is imported (or now, for the modules already imported). Idempotent."""
    patches.apply(LIGHTNING)


def uninstall() -> None:
    """Remove the hook and revert the patches: Lightning behaves as without torchneuron (until install())."""
    patches.undo(LIGHTNING)


@dataclass(frozen=True)
class Integration:
    """A library that can use `neuron`, as `torchneuron info` reports it."""

    library: str
    version: str | None  # None: not installed
    sees_neuron: bool
    how: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def found() -> list[Integration]:
    """The integrations this environment has, each asked whether it sees neuron (imports the libraries)."""
    import torch

    out = []
    module = importlib.util.find_spec("torch_neuronx")
    origin = module.origin if module else None
    out.append(Integration("torch_neuronx", None if module is None else _version("torchneuron") or "in tree",
                           module is not None and hasattr(torch, "neuron"), f"module at {origin}"))
    if (v := _version("transformers")) is not None:
        from transformers.utils import is_torch_neuron_available

        out.append(Integration("transformers", v, is_torch_neuron_available(), "is_torch_neuron_available()"))
    if (v := _version("accelerate")) is not None:
        from accelerate.utils import is_neuron_available

        out.append(Integration("accelerate", v, is_neuron_available(), "is_neuron_available()"))
    for dist, pkg in (("lightning", "lightning.pytorch"), ("pytorch_lightning", "pytorch_lightning")):
        if (v := _version(dist)) is not None:
            accelerators = importlib.import_module(f"{pkg}.accelerators")
            how = "accelerator='neuron' registered" if patches.is_active(LIGHTNING) else "hook removed"
            out.append(Integration(dist, v, "neuron" in accelerators.AcceleratorRegistry, how))
    return out
