"""`nki_op`: an NKI kernel call registered as a `torch.library` custom op, as AWS TorchNeuron's `nki_op` does, so it
runs in eager mode (on CPU or `neuron` tensors), inside `torch.compile(backend="neuron")` as one graph node, and
under autograd with a backward the user registers (`op.register_autograd(...)`, itself calling NKI kernels).

The fake (meta) function is generated: it runs the function's kernels without computing values (shapes, the
hardware rules and the timeline only) on host tensors shaped like the fake inputs, and answers with fake tensors
of the results' shapes; the answer is cached per input signature."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .kernel import MODE


def _shapes_only(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # NKI kernels are specialised to their shapes (as AWS's compiler specialises them): symbolic sizes are
    # specialised here, which guards the compiled graph on them.
    shapes = [[int(d) for d in a.shape] if isinstance(a, torch.Tensor) else None for a in args]
    with unset_fake_temporarily():
        host = [torch.empty(s, dtype=a.dtype) if s is not None else a for a, s in zip(args, shapes, strict=True)]
        MODE.shapes_only = True
        try:
            out = fn(*host, **kwargs)
        finally:
            MODE.shapes_only = False
    return out


def nki_op(name: str, fn: Callable[..., Any] | None = None, *, mutates_args: Iterable[str] | str = (),
           schema: str | None = None) -> Any:
    """Register `fn` (whose body calls NKI kernels on its tensor arguments) as the custom op `name`
    ("namespace::op"). Returns the op (a `torch.library.CustomOpDef`: call it, and `register_autograd` on it)."""
    def wrap(f: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, f, mutates_args=mutates_args, schema=schema)

        def fake(*args: Any, **kwargs: Any) -> Any:
            out = _shapes_only(f, args, kwargs)
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))

            def like(o: Any) -> Any:
                if isinstance(o, torch.Tensor):
                    return torch.empty(o.shape, dtype=o.dtype, device=device)
                if isinstance(o, tuple | list):
                    return type(o)(like(x) for x in o)
                return o
            return like(out)

        op.register_fake(fake)
        return op
    return wrap(fn) if fn is not None else wrap
