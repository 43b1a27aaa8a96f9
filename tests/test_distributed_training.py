"""DDP and FSDP2 (`fully_shard`) training of a small GPT on `neuron` under torchrun (one process per logical
core): 10 steps whose losses equal single-process training on the same global batches."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import batches, init, launch, tiny_gpt, train_losses
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow
STEPS = 10


def _global_loss(loss: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss


def ddp_and_fsdp() -> dict[str, Any]:
    r, n = init()
    dev = torch.device("neuron", torch.neuron.current_device())
    data = batches(STEPS)
    ddp = DDP(tiny_gpt().to(dev), device_ids=[dev.index])
    ddp_losses = train_losses(ddp, data, dev, (r, n), _global_loss)
    fsdp = tiny_gpt().to(dev)
    mesh = init_device_mesh("neuron", (n,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_losses = train_losses(fsdp, data, dev, (r, n), _global_loss)
    sharded = fsdp.head.weight.to_local().shape[0]  # each rank holds its rows of every parameter
    full = {k: v.full_tensor() for k, v in fsdp.state_dict().items()}
    dist.destroy_process_group()
    return {"ddp": ddp_losses, "fsdp": fsdp_losses, "device": (torch.neuron.current_device(),
            torch.neuron.device_count()), "sharded_rows": sharded, "ddp_state": ddp.module.state_dict(),
            "fsdp_state": full}


@pytest.fixture(scope="module")
def single() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_gpt().to("neuron:0")
    return train_losses(model, batches(STEPS), "neuron:0"), model.state_dict()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch("test_distributed_training.py::ddp_and_fsdp", 2, torchrun=True)


def test_torchrun_gives_each_rank_its_core(ranks: list[dict[str, Any]]) -> None:
    assert [r["device"] for r in ranks] == [(0, 4), (1, 4)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_losses_equal_single_process(ranks: list[dict[str, Any]], single: Any, kind: str) -> None:
    losses, state = single
    assert len(losses) == STEPS and losses[-1] < losses[0]
    for r in ranks:
        torch.testing.assert_close(r[kind], losses, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r[f"{kind}_state"], {k: v.cpu() for k, v in state.items()}, rtol=1e-4,
                                   atol=1e-5)


def test_fsdp_shards_parameters(ranks: list[dict[str, Any]]) -> None:
    assert [r["sharded_rows"] for r in ranks] == [32, 32]  # the 64-row head split over 2 ranks
