"""`nki.compiler`: directives to AWS's compiler (scheduling, direct allocation). They do not change what a kernel
computes, so here they are accepted and ignored; `sbuf`/`psum` allocators place tensors in those buffers."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from .core import PSUM, SBUF, Buffer


def skip_middle_end_transformations(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


def enable_stack_allocator(*_: Any, **__: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return lambda fn: fn


@contextmanager
def no_reorder() -> Any:
    yield


class _Allocator:
    """`ncc.sbuf.mod_alloc(...)` / `ncc.psum.alloc(...)`: the buffer (addresses are this model's to choose)."""

    def __init__(self, buffer: Buffer):
        self.buffer = buffer

    def alloc(self, *_: Any, **__: Any) -> Buffer:
        return self.buffer

    mod_alloc = auto_alloc = alloc


sbuf, psum = _Allocator(SBUF), _Allocator(PSUM)


def multi_buffer(n: int) -> None:
    """`directives=ncc.multi_buffer(n)` of a loop: how many buffers the compiler rotates; no effect here."""
    return None
