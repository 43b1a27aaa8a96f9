"""DTensor tensor parallelism on `neuron`: `init_device_mesh("neuron", ...)` and `parallelize_module` with
Colwise/Rowwise (and sequence-parallel) plans train an MLP exactly like the unsharded one."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_helpers import init, launch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

pytestmark = pytest.mark.slow


def tensor_parallel() -> dict[str, Any]:
    r, n = init()
    dev = torch.device("neuron", torch.neuron.current_device())
    mesh = init_device_mesh("neuron", (n,))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(dev)
    seq = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(dev)
    x = torch.randn(4, 2 * n, 16, generator=torch.Generator().manual_seed(1)).to(dev)
    # name: (model, plan, this rank's input, the rank's output as the full tensor)
    plans = {"tp": (mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}, x, lambda y: y),
             "sp": (seq, {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                          "3": RowwiseParallel(output_layouts=Shard(1))},  # activations split on the sequence
                    x.chunk(n, 1)[r], lambda y: DTensor.from_local(y, mesh, [Shard(1)]).full_tensor())}
    out: dict[str, Any] = {}
    for name, (model, plan, local_x, full) in plans.items():
        ref = copy.deepcopy(model)
        sharded = parallelize_module(model, mesh, plan)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, ref)]
        for _ in range(3):
            ys = [sharded(local_x), ref(x)]
            for y, opt in zip(ys, opts, strict=True):  # the global mean of squares, summed over the ranks' parts
                (y.pow(2).sum() / ys[1].numel()).backward()
                opt.step()
                opt.zero_grad()
            out.setdefault(f"{name}_out", []).append((full(ys[0].detach()), ys[1].detach()))
        weights = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
        out[f"{name}_weights"] = (weights, ref.state_dict())
        out[f"{name}_local"] = tuple(sharded[-1].weight.to_local().shape)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch("test_distributed_tensor_parallel.py::tensor_parallel", 2)


@pytest.mark.parametrize("plan", ["tp", "sp"])
def test_parallel_mlp_equals_unsharded(ranks: list[dict[str, Any]], plan: str) -> None:
    for r in ranks:
        for sharded, ref in r[f"{plan}_out"]:
            torch.testing.assert_close(sharded, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*r[f"{plan}_weights"], rtol=1e-5, atol=1e-6)
        assert r[f"{plan}_local"] == (16, 16)  # the row-wise layer's 32 input features split over 2 ranks
