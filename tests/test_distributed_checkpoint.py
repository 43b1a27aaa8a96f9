"""torch.distributed.checkpoint on `neuron`: an FSDP2-sharded GPT saved by 2 ranks loads on 4 (resharded)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_helpers import init, launch, tiny_gpt
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

pytestmark = pytest.mark.slow


def _sharded_gpt(seed: int) -> torch.nn.Module:
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = tiny_gpt(seed).to(torch.device("neuron", torch.neuron.current_device()))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def save(path: str) -> int:
    init()
    model = _sharded_gpt(seed=123)
    dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=path)
    rows = model.head.weight.to_local().shape[0]
    dist.destroy_process_group()
    return rows


def load(path: str) -> dict[str, Any]:
    init()
    model = _sharded_gpt(seed=0)  # different weights: loading must replace every shard
    state = {"model": model.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    out = {"weights": {k: v.full_tensor() for k, v in model.state_dict().items()}, "step": state["step"],
           "rows": model.head.weight.to_local().shape[0]}
    dist.destroy_process_group()
    return out


def test_save_on_2_load_on_4(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert launch("test_distributed_checkpoint.py::save", 2, path) == [32, 32]
    ranks = launch("test_distributed_checkpoint.py::load", 4, path)
    want = tiny_gpt(seed=123).state_dict()
    for r in ranks:
        assert r["rows"] == 16 and r["step"] == 7  # the 64-row head now split over 4 ranks
        torch.testing.assert_close(r["weights"], want, rtol=0, atol=0)
