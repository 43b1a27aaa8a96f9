"""torchneuron: a native PyTorch `neuron` device on a software model of a Trainium NeuronCore, plus migration
tools off CUDA and a Trainium performance and cost model.

Importing this package (or `import torch`, through the `torch.backends` autoload entry point) registers the
device. It stays light: the compiler, profiler, cost model and migration tools load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any


def _autoload() -> None:
    """Entry point of the `torch.backends` group: importing the package registers the device. Defined before
    `import torch` so that `import torchneuron` first (torch then autoloads this package mid-import) works too."""


import torch  # noqa: E402,F401  (loads libtorch before the C++ core links against it)

from ._version import __version__  # noqa: E402,F401  (torchneuron.__version__)
from .hardware import aws as _aws  # noqa: E402

__all__ = ["clear_op_tracking", "get_dtype_events", "get_executed_ops", "get_execution_paths", "get_fallback_ops",
           "set_policies", "estimate", "profiler"]

if _aws.installed() is None:  # ours owns the `neuron` device
    from . import _C  # noqa: F401  (the C++ core: allocator, guard, hooks, fallback, kernels, autocast)
    from .device import module as _module
    from .runtime.policy import set_policies
    from .runtime.tracking import (
        clear_op_tracking,
        get_dtype_events,
        get_executed_ops,
        get_execution_paths,
        get_fallback_ops,
    )

    _module.register()

    from . import distributed as _distributed  # noqa: F401  (registers the "neuron" c10d backend)
    from .compiler import route_default_backend

    route_default_backend()  # plain torch.compile(model) on neuron tensors reaches the neuron backend

    from .compiler import eager_fusion as _eager_fusion

    _eager_fusion.install()  # stream workers may fuse runs of queued ops (Inductor loads at the first compile)

    from .hardware import config as _config

    _cfg = _config.current_or_none()  # None: invalid, raised at the first use of the device
    if _cfg is not None and _cfg.cuda_compat:  # compat mode loads only when asked for (~9 ms of import otherwise)
        from .integrations.cuda_compat import maybe_enable_from_env

        maybe_enable_from_env()  # TORCHNEURON_CUDA_COMPAT=1: unmodified CUDA code runs on neuron
        if _cfg.porting_report:  # TORCHNEURON_PORTING_REPORT=path.json|path.md|-: the porting report at exit
            import atexit

            from .integrations import porting_report as _porting_report

            atexit.register(_porting_report.write_at_exit, _cfg.porting_report)

    from .integrations import install as _install_integrations

    _install_integrations()  # Lightning learns accelerator="neuron" when (and if) it is imported

    from .nki import install_alias as _install_nki_alias

    _install_nki_alias()  # `import nki` serves torchneuron.nki unless another nki (AWS's) is installed
else:  # AWS's torch-neuronx owns it: register nothing, load no kernels (docs/ecosystem.md)
    import warnings

    warnings.warn(_aws.stand_down_message(), RuntimeWarning, stacklevel=2)


_LAZY = {"estimate": ("torchneuron.costmodel.estimate", "estimate"), "profiler": ("torchneuron.profiler", None),
         "nki_op": ("torchneuron.nki.torch_op", "nki_op"), "nki": ("torchneuron.nki", None)}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return getattr(m, attr) if attr else m
    raise AttributeError(f"module 'torchneuron' has no attribute {name!r}")
