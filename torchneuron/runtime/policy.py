"""Applies the device policies (dtype rules, fallback behaviour) and the op table to the C++ core."""
from __future__ import annotations

from .. import _C
from ..hardware.config import DTYPE_POLICIES, FALLBACK_POLICIES
from .optable import names


def set_policies(dtype_policy: str | None = None, fallback_policy: str | None = None) -> None:
    """Change the policies at run time (the environment sets them at start-up); None keeps the current one."""
    from ..device import module

    cfg = module._loaded_config()  # not a use of the device: LOCAL_RANK is not checked here
    dtype_policy = dtype_policy or cfg.dtype_policy
    fallback_policy = fallback_policy or cfg.fallback_policy
    if dtype_policy not in DTYPE_POLICIES or fallback_policy not in FALLBACK_POLICIES:
        raise ValueError(f"dtype policy must be one of {DTYPE_POLICIES} and fallback policy one of "
                         f"{FALLBACK_POLICIES}; got {dtype_policy!r}, {fallback_policy!r}")
    _C._set_policies(dtype_policy, fallback_policy)
    module._set_config(dtype_policy=dtype_policy, fallback_policy=fallback_policy)


def install_op_tables() -> None:
    """Hand the op table's per-base-name facts to the C++ core (runtime/optable.py)."""
    _C._set_op_table(names("native"), names("exact"), names("host_tensors"))
