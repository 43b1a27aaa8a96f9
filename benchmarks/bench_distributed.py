"""Distributed benchmarks: all_reduce bus bandwidth on `neuron` (backend "neuron") against gloo on plain CPU
tensors, and a small-GPT DDP training step with 1 and 2 processes, neuron against CPU.

`run(quick)` launches the worker processes itself (this file, run as a script with torchrun's variables) and
returns rows {name, neuron, cpu, ratio, unit, threads}: medians over rounds that time neuron and CPU in turn,
and the median of the per-round ratios. Bandwidth rows are GB/s (ratio = neuron / cpu, higher is better);
step rows are milliseconds (ratio = neuron / cpu, lower is better).
Rows named *_unchecked run without the per-collective agreement check (TORCHNEURON_DIST_CHECKS=0).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _paired(runs: dict[str, Callable[[], None]], rounds: int, group_of: dict[str, Any]) -> dict[str, float]:
    """Median time of each run, timed once per round in rotating order (after a barrier, so that every rank starts
    together), plus "ratio:<kind>": the median over rounds of cpu's time / kind's time. Pairing runs within a
    round makes the ratio robust to the load of a shared machine; round 0 warms up and is dropped."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in runs}
    kinds = list(runs)
    for r in range(rounds + 1):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # rotate: no run always goes first
            run = runs[kind]
            dist.barrier(group_of[kind])
            t0 = time.perf_counter()
            run()
            if r:
                times[kind].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"ratio:{k}": statistics.median(c / t for c, t in zip(times["cpu"], v, strict=True))
                for k, v in times.items()})
    return out


def _allreduce_worker(sizes_mib: list[int], rounds: tuple[int, int], unchecked: bool) -> list[dict]:
    """Bus bandwidth of all_reduce on float32 tensors, (min, max) `rounds` per size (fewer for larger sizes);
    `unchecked` adds rows without the agreement check."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    groups = {"neuron": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}
    groups.update({"unchecked": dist.group.WORLD} if unchecked else {})
    rows = []
    for mib in sizes_mib:
        tensors = {k: torch.zeros(mib * MIB // 4, device="cpu" if k == "cpu" else f"neuron:{rank}") for k in groups}

        def run(kind: str, tensor: torch.Tensor) -> Callable[[], None]:
            def go() -> None:
                os.environ["TORCHNEURON_DIST_CHECKS"] = "0" if kind == "unchecked" else "1"
                dist.all_reduce(tensor, group=groups[kind])
            return go
        t = _paired({k: run(k, tensors[k]) for k in groups}, max(rounds[0], min(rounds[1], 2048 // mib)), groups)
        busbw = {k: mib * MIB * 2 * (n - 1) / n / t[k] / 1e9 for k in groups}
        rows += [{"name": f"all_reduce_busbw_{mib}MiB_{n}proc" + ("_unchecked" if k == "unchecked" else ""),
                  "neuron": busbw[k], "cpu": busbw["cpu"], "ratio": t[f"ratio:{k}"], "unit": "GB/s"}
                 for k in groups if k != "cpu"]
    return rows


def _gpt(device: str):
    """torchneuron.models.TinyGPT without dropout (2 pre-norm causal blocks, d=64, 128 tokens of context)."""
    import torch

    from torchneuron.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0)).to(device)


def _ddp_worker(rounds: int) -> list[dict]:
    """A DDP training step (AdamW, 8 sequences of 64 tokens per rank), neuron and CPU in alternation."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, rank = dist.get_world_size(), dist.get_rank()
    groups = {"neuron": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}

    def step(device: str) -> Callable[[], None]:
        model = DDP(_gpt(device), process_group=groups["cpu" if device == "cpu" else "neuron"])
        opt, x = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randint(128, (8, 64), device=device)

        def go() -> None:
            model(x, x.roll(-1, 1))[1].backward()
            opt.step()
            opt.zero_grad()
        return go
    t = _paired({"neuron": step(f"neuron:{rank}"), "cpu": step("cpu")}, rounds, groups)
    return [{"name": f"ddp_gpt_step_{n}proc", "neuron": t["neuron"] * 1e3, "cpu": t["cpu"] * 1e3,
             "ratio": 1 / t["ratio:neuron"], "unit": "ms"}]


def _launch(nprocs: int, kind: str, args: dict, threads: int, timeout: float = 900) -> list[dict]:
    """Run this file's `kind` worker on `nprocs` ranks (torchrun's variables, `threads` threads each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        base = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHNEURON_FALLBACK": "silent",
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
    """Each rank runs with the caller's torch thread count (benchmarks/run.py sets it per pass)."""
    import torch

    threads = torch.get_num_threads()
    sizes = [1, 16, 64] if quick else [1, 4, 16, 64, 256]
    rows = _launch(2, "allreduce", {"sizes_mib": sizes, "rounds": (8, 16) if quick else (20, 64),
                                    "unchecked": not quick}, threads)
    for nprocs in (1, 2):
        rows += _launch(nprocs, "ddp", {"rounds": 10 if quick else 40}, threads)
    return [{**row, "threads": threads} for row in rows]


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
        import torch

        torch.set_num_threads(1)
        for row in run(quick="--quick" in sys.argv):
            print(f"{row['name']:32s} neuron {row['neuron']:9.3f}  cpu {row['cpu']:9.3f} {row['unit']:5s} "
                  f"ratio {row['ratio']:.3f}")
