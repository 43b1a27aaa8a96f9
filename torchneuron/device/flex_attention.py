"""FlexAttention (`torch.nn.attention.flex_attention`) on `neuron`.

torch's entry point checks the inputs' device against a fixed set (CUDA, CPU, XPU, HPU, MPS) and refuses any other.
Everything behind the check is device-generic: eager calls run the higher-order op's dense implementation (scores
materialised, `score_mod` applied by vmap, block-mask-derived mask, safe softmax) and its autograd formula, in device
ops; `create_block_mask(..., device="neuron")` builds the block mask with device ops. So the patch widens the check to
accept `neuron` (forward and backward: the dense backward is correct here, where torch's CPU refuses it) and leaves
every other device's answer as torch gives it. Compiled graphs run the same dense implementation between kernels
(the compiler's `eager_fused_attention` pass; docs/compiler.md).

`import torch` does not import the module: an import hook (a sys.meta_path entry that answers only for it) patches
it when it is first imported, or at once if it already was.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..runtime import patches

MODULE = "torch.nn.attention.flex_attention"
DEVICE = "neuron"


def _widen(module: ModuleType) -> None:
    """Replace the module's device check by one that accepts `neuron` and defers to torch's for every other device."""
    original = module._validate_device

    def _validate_device(query: Any, key: Any, value: Any) -> None:
        if query.device.type == DEVICE:
            return
        original(query, key, value)

    patches.applied(WIDEN_DEVICE_CHECK).replace(module, "_validate_device",
                                                functools.wraps(original)(_validate_device))


def _patch(module: ModuleType) -> None:
    if patches.is_active(WIDEN_DEVICE_CHECK):
        _widen(module)


_HOOK = patches.ImportHook({MODULE: _patch})


def _install(done: patches.Applied) -> None:
    _HOOK.install()


WIDEN_DEVICE_CHECK = patches.declare(
    "flex-attention-device", f"{MODULE}._validate_device (through a sys.meta_path hook until it is imported)",
    "flex_attention's device check names a fixed set of devices; its dense implementation runs on neuron as is",
    "tests/test_flex_attention.py::test_device_check_is_widened_only_for_neuron_and_undone", _install,
    undo=_HOOK.uninstall)
