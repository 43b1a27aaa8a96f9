"""`torch.compile` of a small-GPT training step: backend="neuron" on the device vs Inductor on plain CPU.

Steady state runs each side in a process of its own, taking turns (median of repeats; benchmarks/common.py).
Compile times need cold caches on both sides, so each compile runs in a fresh process with fresh cache directories,
alternating neuron and CPU; the warm-cache row compiles the neuron side again in a fresh process that reuses its
on-disk cache.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable

import torch
import torch._dynamo

from benchmarks.common import FOREACH, paired, row
from torchneuron.models import GPTConfig, TinyGPT, gpt_batch

BATCH = 8

# One cold (or warm) compile in a fresh process: prints the seconds from torch.compile to the end of the first
# training step (forward, backward, optimizer step) minus the same step run eagerly afterwards.
_COMPILE = textwrap.dedent("""
    import json, sys, time, torch
    from torchneuron.models import GPTConfig, TinyGPT, gpt_batch
    device, threads, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device)
    x, y = (t.to(device) for t in gpt_batch(cfg, batch, torch.Generator().manual_seed(0)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    def step(fn):
        loss = fn(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    step(model)  # warm the eager paths (allocator, optimizer state) so only the compile is timed
    t0 = time.perf_counter()
    step(torch.compile(model, backend="neuron" if device == "neuron" else "inductor"))
    t1 = time.perf_counter()
    step(model)
    print(json.dumps({"seconds": (t1 - t0) - (time.perf_counter() - t1)}))
""")


def _compile_seconds(device: str, cache: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHNEURON_", "TORCHINDUCTOR_"))}
    env.update(TORCHNEURON_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    if device == "neuron":
        env.pop("TORCHINDUCTOR_CACHE_DIR")  # the neuron compiler keeps Inductor's kernels in its own cache
    p = subprocess.run([sys.executable, "-c", _COMPILE, device, str(torch.get_num_threads()), str(BATCH)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"compile benchmark ({device}) failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["seconds"]


def compile_times(repeats: int) -> dict[str, list[float]]:
    """Cold neuron, cold CPU (alternating order) and warm neuron compile seconds, `repeats` of each."""
    times: dict[str, list[float]] = {"neuron": [], "cpu": [], "warm": []}
    for r in range(repeats):
        with tempfile.TemporaryDirectory() as neuron_cache, tempfile.TemporaryDirectory() as cpu_cache:
            for device in ("neuron", "cpu") if r % 2 == 0 else ("cpu", "neuron"):
                times[device].append(_compile_seconds(device, neuron_cache if device == "neuron" else cpu_cache))
            times["warm"].append(_compile_seconds("neuron", neuron_cache))
    return times


def compiled_step(device: str, dropout: float) -> Callable[[], None]:
    """A training step of the small GPT compiled for `device` (backend "neuron", or Inductor on the CPU), its
    compile cache in a fresh directory."""
    os.environ["TORCHNEURON_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchneuron-bench-")
    cfg = GPTConfig(dropout=dropout)
    torch.manual_seed(0)
    m = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=FOREACH)
    fn = torch.compile(m, backend="neuron" if device == "neuron" else "inductor")
    x, y = (t.to(device) for t in gpt_batch(cfg, BATCH, torch.Generator().manual_seed(0)))

    def step() -> None:
        loss = fn(x, y)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def run(quick: bool = False) -> list[dict]:
    timing = {"calls": 3, "repeats": 5, "min_turn": 0.1} if quick else {"calls": 8, "repeats": 9, "min_turn": 0.3}
    t = paired(compiled_step, **timing, dropout=GPTConfig.dropout)
    rows = [row("small-GPT train step, compiled", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", 1.05)]
    # Dropout draws its masks differently on each side (eager's generator on neuron, so results equal eager;
    # Inductor's own in-kernel RNG on the CPU): without it the row compares the compiled code alone.
    t = paired(compiled_step, **timing, dropout=0.0)
    rows.append(row("  same, dropout=0", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", 1.05))
    c = {k: statistics.median(v) for k, v in compile_times(1 if quick else 3).items()}
    rows.append(row("small-GPT cold compile", c["neuron"], c["cpu"], "s", 1.2))
    warm = row("small-GPT neuron compile, warm/cold cache", c["warm"], c["neuron"], "s", 1 / 3)
    rows.append(warm)
    return rows
