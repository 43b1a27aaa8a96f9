"""`nki.typing`: annotations kernels use for their arguments (`tensor`, `tensor[shape, dtype]`); no checks."""
from __future__ import annotations

from typing import Any


class _Tensor:
    def __getitem__(self, _: Any) -> _Tensor:
        return self

    def __repr__(self) -> str:
        return "nki.typing.tensor"


tensor = _Tensor()
