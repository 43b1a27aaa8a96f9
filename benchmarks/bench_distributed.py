"""Distributed benchmarks: all_reduce bus bandwidth on `neuron` (backend "neuron") against gloo on plain CPU
tensors, and a small-GPT DDP training step with 1 and 2 processes, neuron against CPU.

`run(quick)` launches the worker processes itself (this file, run as a script with torchrun's variables) and
returns rows {name, neuron, cpu, ratio, unit, threads}. Bandwidth rows are GB/s (ratio = neuron / cpu, higher
is better); step rows are milliseconds (ratio = neuron / cpu, lower is better). Each rank uses one thread.
Rows named *_unchecked run without the per-collective agreement check (TORCHNEURON_DIST_CHECKS=0).
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


def _allreduce_worker(sizes_mib: list[int], rounds: int, unchecked: bool) -> list[dict]:
    """Bus bandwidth of all_reduce on float32 tensors; `unchecked` adds rows without the agreement check."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    kinds = {"neuron": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}
    kinds.update({"unchecked": dist.group.WORLD} if unchecked else {})
    rows = []
    for mib in sizes_mib:
        devices = {k: torch.device("cpu") if k == "cpu" else torch.device("neuron", rank) for k in kinds}
        tensors = {k: torch.zeros(mib * MIB // 4, device=devices[k]) for k in kinds}
        best = {k: float("inf") for k in kinds}
        for r in range(rounds + 1):  # alternate single runs so that machine noise hits all alike; 0 warms up
            for kind, group in kinds.items():
                os.environ["TORCHNEURON_DIST_CHECKS"] = "0" if kind == "unchecked" else "1"
                dist.barrier(group)
                t0 = time.perf_counter()
                dist.all_reduce(tensors[kind], group=group)
                best[kind] = min(best[kind], time.perf_counter() - t0) if r else best[kind]
        busbw = {k: mib * MIB * 2 * (n - 1) / n / t / 1e9 for k, t in best.items()}
        rows += [{"name": f"all_reduce_busbw_{mib}MiB_{n}proc" + ("_unchecked" if k == "unchecked" else ""),
                  "neuron": busbw[k], "cpu": busbw["cpu"], "ratio": busbw[k] / busbw["cpu"], "unit": "GB/s"}
                 for k in kinds if k != "cpu"]
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


def _step_ms(model, x, group, steps: int, rounds: int) -> float:
    """Best time of an AdamW training step (loss read back each step) over `rounds` timed runs of `steps`."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    best = float("inf")
    for r in range(rounds + 1):  # run 0 warms up
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(steps):
            F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
            opt.step()
            opt.zero_grad()
        best = min(best, (time.perf_counter() - t0) / steps * 1e3) if r else best
    return best


def _ddp_worker(steps: int, rounds: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, rank = dist.get_world_size(), dist.get_rank()
    ms = {}
    for kind, group, device in (("neuron", dist.group.WORLD, f"neuron:{rank}"),
                                ("cpu", dist.new_group(backend="gloo"), "cpu")):
        x = torch.randint(128, (8, 64), device=device)  # 8 sequences of 64 tokens per rank
        ms[kind] = _step_ms(DDP(_gpt(device), process_group=group), x, group, steps, rounds)
    return [{"name": f"ddp_gpt_step_{n}proc", "neuron": ms["neuron"], "cpu": ms["cpu"],
             "ratio": ms["neuron"] / ms["cpu"], "unit": "ms"}]


def _launch(nprocs: int, kind: str, args: dict, timeout: float = 900) -> list[dict]:
    """Run this file's `kind` worker on `nprocs` ranks (torchrun's variables, one thread each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        base = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHNEURON_FALLBACK": "silent",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs)}
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
    rows = _launch(2, "allreduce", {"sizes_mib": sizes, "rounds": 8 if quick else 20, "unchecked": not quick})
    for nprocs in (1, 2):
        rows += _launch(nprocs, "ddp", {"steps": 3 if quick else 10, "rounds": 2 if quick else 3})
    return [{**row, "threads": 1} for row in rows]


def _main() -> None:
    import torch.distributed as dist

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
