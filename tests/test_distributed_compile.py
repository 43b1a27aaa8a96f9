"""Functional collectives inside `torch.compile(backend="neuron")` graphs: traced as `_c10d_functional` ops,
run through the neuron process group, equal to eager, with no graph break or eager fallback."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from dist_helpers import init, launch

pytestmark = pytest.mark.slow


def _step(x: torch.Tensor) -> torch.Tensor:
    g = dist.group.WORLD
    y = fc.all_reduce(x * 2, "sum", g)
    z = fc.reduce_scatter_tensor(fc.all_gather_tensor(y + 1, 0, g), "avg", 0, g)
    return z.sin() + fc.all_to_all_single(x, None, None, g)


def compiled() -> dict[str, Any]:
    r, _ = init()
    x = torch.arange(8.0, device=torch.device("neuron", torch.neuron.current_device())) + r
    torch.neuron.reset_dynamo_metrics()
    out = {"eager": _step(x), "compiled": torch.compile(_step, backend="neuron", fullgraph=True)(x),
           "metrics": [{k: m[k] for k in ("nodes", "fallback", "error", "graph_break")}
                       for m in torch.neuron.get_dynamo_metrics()]}
    dist.destroy_process_group()
    return out


def test_functional_collectives_in_a_compiled_graph() -> None:
    for r in launch("test_distributed_compile.py::compiled", 2):
        torch.testing.assert_close(r["compiled"], r["eager"])
        (m,) = r["metrics"]  # one graph, collectives and all: no break, no eager fallback
        assert m["nodes"] > 8 and m["fallback"] is None and m["error"] is None and m["graph_break"] is None, m
