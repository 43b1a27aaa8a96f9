"""Applies the device policies (dtype rules, fallback behaviour) and the op table to the C++ core."""
from __future__ import annotations

from .. import _C
from ..hardware import config
from .optable import names, structured


def set_policies(dtype_policy: str | None = None, fallback_policy: str | None = None) -> None:
    """Change the policies at run time (the environment sets them at start-up); None keeps the current one."""
    cfg = config.current()  # not a use of the device: LOCAL_RANK is not checked here
    dtype_policy = dtype_policy or cfg.dtype_policy
    fallback_policy = fallback_policy or cfg.fallback_policy
    _C._set_policies(dtype_policy, fallback_policy)  # ValueError listing the valid names; nothing changes then
    config.update(dtype_policy=dtype_policy, fallback_policy=fallback_policy)


def install_op_tables() -> None:
    """Hand the op table's per-base-name facts to the C++ core (runtime/optable.py)."""
    _C._set_op_table(names("native"), names("exact"), names("host_tensors"), names("indices"), names("overwrites"),
                     names("recurrent"), structured())
