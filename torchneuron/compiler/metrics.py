"""Per-graph compile metrics of `torch.compile(backend="neuron")`, read by
`torch.neuron.get_dynamo_metrics()`.

One row per compiled graph and input signature: name, node count, compile time, whether every kernel came from
the on-disk cache, how many earlier compiles the same graph had in this process (recompiles), the graph break
that ended it, and any fallback taken. `reset()` clears the rows; recompile counts are facts of the process
and stay."""
from __future__ import annotations

import copy
import threading

from ..device import module

_LOCK = threading.Lock()
_ROWS: list[dict] = []
_COMPILES: dict[str, int] = {}  # graph name -> compiles since the last reset


def next_compile(name: str) -> int:
    """Count a compile of `name`; returns how many compiles of it came before (its recompile number)."""
    with _LOCK:
        _COMPILES[name] = _COMPILES.get(name, 0) + 1
        return _COMPILES[name] - 1


def record(row: dict) -> None:
    with _LOCK:
        _ROWS.append(row)


def get() -> list[dict]:
    """A copy of all rows since the last reset, oldest first."""
    with _LOCK:
        return copy.deepcopy(_ROWS)


def reset() -> None:
    with _LOCK:
        _ROWS.clear()
        _COMPILES.clear()


module.set_dynamo_metrics_source(get, reset)  # torch.neuron.get_dynamo_metrics / reset_dynamo_metrics
