"""The "neuron" c10d backend's registration and the ways to start a group: `backend="neuron"`,
`device_id=torch.device("neuron", i)` alone, no arguments at all, and a "cpu:gloo,neuron:neuron" string;
each rank on its own logical core (LOCAL_RANK), the group's introspection like a built-in one's."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_py
from dist_helpers import child_env, launch

pytestmark = pytest.mark.slow
STYLES = ["backend", "device_id", "default", "mixed"]


def test_registered_for_the_neuron_device() -> None:
    assert "neuron" in dist.Backend.backend_list and dist.is_backend_available("neuron")
    assert dist.get_default_backend_for_device("neuron") == "neuron"
    assert dist.get_default_backend_for_device(torch.device("neuron", 1)) == "neuron"
    assert dist.get_default_backend_for_device("cpu") == "gloo"  # CPU keeps its default
    assert dist.Backend.NEURON == "neuron"


def test_import_torch_alone_registers_it_and_stays_light() -> None:
    out = run_py("""
        import sys, torch, torch.distributed as d
        print(d.get_default_backend_for_device("neuron"))
        print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))))
    """, env=child_env())
    assert out.stdout.split() == ["neuron", "[]"], out.stdout


def init_styles() -> list[dict[str, Any]]:
    """Each way of starting a group, in turn, in the same processes."""
    import os

    local = int(os.environ["LOCAL_RANK"])
    kwargs = {"backend": {"backend": "neuron"}, "device_id": {"device_id": torch.device("neuron", local)},
              "default": {}, "mixed": {"backend": "cpu:gloo,neuron:neuron"}}
    out = []
    for style in STYLES:
        dist.init_process_group(**kwargs[style])
        t = torch.full((3,), float(dist.get_rank() + 1), device="neuron")  # on the current core: LOCAL_RANK
        dist.all_reduce(t)
        g = dist.group.WORLD
        out.append({"style": style, "type": type(g).__name__, "name": g.name(), "sum": t, "device": t.device,
                    "current": torch.neuron.current_device(), "count": torch.neuron.device_count(),
                    "devices": sorted(d.type for d in g._device_types),
                    "gloo_inside": type(g._get_backend(torch.device("neuron"))).__name__})
        del g  # a destroyed group still referenced keeps its store listening: re-init could meet it (any backend)
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, Any]]]:
    return launch("test_distributed_backend.py::init_styles", 2)


@pytest.mark.parametrize("style", STYLES)
def test_init_styles_make_a_neuron_group(ranks: list[list[dict[str, Any]]], style: str) -> None:
    for rank, results in enumerate(ranks):
        r = results[STYLES.index(style)]
        assert (r["type"], r["name"], r["devices"], r["gloo_inside"]) == (
            "ProcessGroupNeuron", "neuron", ["cpu", "neuron"], "ProcessGroupGloo"), r
        assert r["device"] == torch.device("neuron", rank) and (r["current"], r["count"]) == (rank, 4), r
        assert r["sum"].tolist() == [3.0, 3.0, 3.0]
