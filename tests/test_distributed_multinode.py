"""Multi-node: two "hosts" (network namespaces joined by a veth pair, made here) each run
`torchrun --nnodes=2 --nproc-per-node=2` with c10d rendezvous; DDP training of the small GPT over the 4 ranks
gives the same losses as single-process training. Skipped where the sandbox cannot create namespaces."""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import HERE, batches, child_env, init, run_commands, tiny_gpt, train_losses, two_hosts
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow
STEPS = 10


def train() -> dict[str, Any]:
    r, n = init()
    dev = torch.device("neuron", torch.neuron.current_device())
    model = DDP(tiny_gpt().to(dev), device_ids=[dev.index])
    losses = train_losses(model, batches(STEPS), dev, (r, n),
                          lambda loss: (dist.all_reduce(loss, op=dist.ReduceOp.AVG), loss)[1])
    where: list[Any] = [None] * n  # each rank's host (its namespace's interface) and core
    dist.all_gather_object(where, (os.environ["GLOO_SOCKET_IFNAME"], dev.index))
    dist.destroy_process_group()
    return {"losses": losses, "where": where}


def _torchrun_on(hosts: list[tuple[str, str, str]], outdir: Path) -> list[Any]:
    """torchrun on each host (inside its namespace), rendezvous at the first host's address."""
    cmds, envs = [], []
    for node, (ns, addr, dev) in enumerate(hosts):
        cmds.append(["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                     "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={hosts[0][1]}:29400", "--rdzv-id=torchneuron-multinode",
                     f"--rdzv-conf=is_host={node == 0}", f"--local-addr={addr}", "--max-restarts=0",
                     str(HERE / "dist_helpers.py"), f"{Path(__file__).resolve()}::train", str(outdir)])
        envs.append(child_env(GLOO_SOCKET_IFNAME=dev))  # gloo talks over the host's veth only
    (outdir / "args.pkl").write_bytes(pickle.dumps(()))
    return run_commands(cmds, envs, outdir, timeout=240)


def test_two_hosts_train_like_one_process(tmp_path: Path) -> None:
    try:
        with two_hosts() as hosts:
            ranks = _torchrun_on(hosts, tmp_path)
    except PermissionError as e:
        pytest.skip(f"cannot create network namespaces here: {e}")
    assert len(ranks) == 4
    single = train_losses(tiny_gpt().to("neuron:0"), batches(STEPS), "neuron:0")
    for r in ranks:
        torch.testing.assert_close(r["losses"], single, rtol=1e-5, atol=1e-5)
    assert sorted(ranks[0]["where"]) == sorted((h[2], core) for h in hosts for core in (0, 1))  # 2 a host
