"""DTensor tensor parallelism on `neuron`: `init_device_mesh("neuron", ...)` and `parallelize_module` with
Colwise/Rowwise (and sequence-parallel) plans train an MLP exactly like the unsharded one; DTensor's parallel RNG
draws on each rank's shard the values of that slice of the unsharded tensor."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import init, launch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
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


def parallel_rng() -> dict[str, torch.Tensor]:
    """Random ops on DTensors sharded by rows: DTensor's tracker moves the neuron generator's offset to each shard's
    first position (its rule for CUDA's [seed, offset] state) and past the whole tensor after."""
    _, n = init()
    dev = torch.device("neuron", torch.neuron.current_device())
    mesh = init_device_mesh("neuron", (n,))
    torch.manual_seed(5)
    ones = distribute_tensor(torch.ones(4 * n, 24, device=dev), mesh, [Shard(0)])
    out = {"dropout": F.dropout(ones, 0.5).full_tensor().cpu(),
           "uniform": nn.init.uniform_(distribute_tensor(torch.empty(4 * n, 24, device=dev), mesh, [Shard(0)]))
           .full_tensor().cpu()}
    dist.destroy_process_group()
    return out


def test_dtensor_random_ops_draw_the_unsharded_values() -> None:
    """Dropout's mask and `uniform_` on a row-sharded DTensor over 2 ranks equal, gathered, the same ops on the whole
    tensor from the same seed and offset: each value depends on (seed, offset + position) alone."""
    ranks = launch("test_distributed_tensor_parallel.py::parallel_rng", 2)
    torch.manual_seed(5)
    drop = F.dropout(torch.ones(8, 24, device="neuron"), 0.5).cpu()
    uniform = torch.empty(8, 24, device="neuron").uniform_().cpu()
    assert 0 < (drop == 0).sum() < drop.numel()
    for r in ranks:
        assert torch.equal(r["dropout"], drop)
        assert torch.equal(r["uniform"], uniform)
