"""Distributed benchmarks: all_reduce bus bandwidth on `neuron` (backend "neuron") against gloo on plain CPU
tensors, and a small-GPT DDP training step with 1 and 2 processes, neuron against CPU.

`run(quick)` launches the worker processes itself (this file, run as a script with torchrun's variables) and
returns rows {name, neuron, cpu, ratio, unit, threads}. Bandwidth rows are GB/s (ratio = neuron / cpu, higher
is better); step rows are milliseconds (ratio = neuron / cpu, lower is better). Each rank uses one thread.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20


def _allreduce_worker(sizes_mib: list[int], rounds: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    groups = {"neuron": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}
    rows = []
    for mib in sizes_mib:
        tensors = {"neuron": torch.zeros(mib * MIB // 4, device=torch.device("neuron", dist.get_rank())),
                   "cpu": torch.zeros(mib * MIB // 4)}
        best = {kind: float("inf") for kind in groups}
        for kind in groups:  # warm up: connections, buffers, page faults
            dist.all_reduce(tensors[kind], group=groups[kind])
        for _ in range(rounds):  # alternate single runs so that machine noise hits both alike; keep the best
            for kind, group in groups.items():
                dist.barrier(group)
                t0 = time.perf_counter()
                dist.all_reduce(tensors[kind], group=group)
                best[kind] = min(best[kind], time.perf_counter() - t0)
        busbw = {k: mib * MIB * 2 * (n - 1) / n / t / 1e9 for k, t in best.items()}
        rows.append({"name": f"all_reduce_busbw_{mib}MiB_{n}proc", "neuron": busbw["neuron"], "cpu": busbw["cpu"],
                     "ratio": busbw["neuron"] / busbw["cpu"], "unit": "GB/s"})
    return rows


def _gpt(device: str):
    """A small GPT from torch's own layers (2 pre-norm causal blocks, d=64)."""
    import torch.nn as nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.head = nn.Embedding(128, 64), nn.Linear(64, 128)
            layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, 2)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
            return self.head(self.blocks(self.tok(x), mask=mask, is_causal=True))

    import torch

    torch.manual_seed(0)
    return GPT().to(device)


def _ddp_worker(steps: int, rounds: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, groups = dist.get_world_size(), {"neuron": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}
    devices = {"neuron": f"neuron:{dist.get_rank()}", "cpu": "cpu"}
    best = {}
    for kind, group in groups.items():
        model = DDP(_gpt(devices[kind]), process_group=group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(128, (8, 64), device=devices[kind])  # 8 sequences per rank

        def step() -> None:
            loss = F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
        step()
        for _ in range(rounds):
            dist.barrier(group)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            best[kind] = min(best.get(kind, float("inf")), (time.perf_counter() - t0) / steps * 1e3)
    return [{"name": f"ddp_gpt_step_{n}proc", "neuron": best["neuron"], "cpu": best["cpu"],
             "ratio": best["neuron"] / best["cpu"], "unit": "ms"}]


def _launch(nprocs: int, kind: str, args: dict, timeout: float = 900) -> list[dict]:
    """Run this file's `kind` worker on `nprocs` ranks (torchrun's variables, one thread each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHNEURON_", "NEURON_", "LOCAL_"))}
        base.update(OMP_NUM_THREADS="1", TORCHNEURON_FALLBACK="silent", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), WORLD_SIZE=str(nprocs))
        procs = [subprocess.Popen([sys.executable, __file__, kind, json.dumps(args), str(out)],
                                  env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nprocs)]
        try:
            codes = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            raise RuntimeError(f"distributed benchmark {kind} failed: exit codes {codes}")
        return json.loads(out.read_text())


def run(quick: bool = False) -> list[dict]:
    sizes = [1, 16, 64] if quick else [1, 4, 16, 64, 256]
    rows = _launch(2, "allreduce", {"sizes_mib": sizes, "rounds": 8 if quick else 20})
    for nprocs in (1, 2):
        rows += _launch(nprocs, "ddp", {"steps": 3 if quick else 10, "rounds": 2 if quick else 3})
    return [{**row, "threads": 1} for row in rows]


def _main() -> None:
    import torch.distributed as dist

    import torchneuron.distributed  # noqa: F401  (registers the backend until autoload does)

    kind, args, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("neuron")
    rows = {"allreduce": _allreduce_worker, "ddp": _ddp_worker}[kind](**args)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 4:  # a worker rank
        _main()
    else:
        for row in run(quick="--quick" in sys.argv):
            print(f"{row['name']:32s} neuron {row['neuron']:9.3f}  cpu {row['cpu']:9.3f} {row['unit']:5s} "
                  f"ratio {row['ratio']:.3f}")
