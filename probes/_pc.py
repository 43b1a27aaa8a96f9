"""Shared helpers for the issue-26 probes: queued slow work, a queued failing kernel, and a check recorder."""
from __future__ import annotations

import sys

import torch

DEV = "neuron"
_X = _W = None
RESULTS: list[tuple[bool, str]] = []


def setup() -> None:
    global _X, _W
    g = torch.Generator().manual_seed(0)
    _X = torch.randn(1024, 1024, generator=g).to(DEV)
    _W = (torch.randn(1024, 1024, generator=g) / 32).to(DEV)
    slow(1)
    torch.neuron.synchronize()


def slow(n: int = 6) -> torch.Tensor:
    """~0.2 s of dependent 1024x1024 matmuls queued on the current stream."""
    if _X is None:
        setup()
    y = _X
    for _ in range(n):
        y = torch.tanh(y @ _W)
    return y


def failing(src: torch.Tensor | None = None, busy: bool = True) -> torch.Tensor:
    """A queued index_select with an out-of-range index (its signature made known first)."""
    if src is None:
        src = torch.randn(8, 4, device=DEV)
    torch.index_select(src, 0, torch.tensor([0, 1], device=src.device)) + 1
    if busy:
        slow()
    return torch.index_select(src, 0, torch.tensor([0, 99], device=src.device))


def check(ok: bool, what: str) -> None:
    RESULTS.append((bool(ok), what))
    print(("PASS " if ok else "FAIL ") + what, flush=True)


def raises(fn, exc=Exception, match: str | None = None, what: str = "") -> BaseException | None:
    """Record whether fn() raises exc (with `match` in its message)."""
    try:
        v = fn()
    except exc as e:  # noqa: BLE001
        ok = match is None or match in str(e)
        check(ok, f"{what}: raised {type(e).__name__}" + ("" if ok else f" but message lacks {match!r}: {str(e)[:200]}"))
        return e
    except BaseException as e:  # noqa: BLE001
        check(False, f"{what}: raised {type(e).__name__} (wanted {exc.__name__}): {str(e)[:300]}")
        return e
    check(False, f"{what}: no error (wanted {exc.__name__}); returned {str(v)[:200]}")
    return None


def no_raise(fn, what: str = ""):
    try:
        v = fn()
    except BaseException as e:  # noqa: BLE001
        check(False, f"{what}: unexpected {type(e).__name__}: {str(e)[:300]}")
        return None
    check(True, what)
    return v


def drain() -> None:
    """Synchronize until nothing is pending (errors of previous cases reported here)."""
    for _ in range(8):
        try:
            torch.neuron.synchronize()
            return
        except Exception:  # noqa: BLE001
            pass


def done() -> None:
    bad = [w for ok, w in RESULTS if not ok]
    print(f"== {len(RESULTS) - len(bad)} passed, {len(bad)} failed")
    sys.stdout.flush()
