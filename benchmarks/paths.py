"""The execution paths of one eager training step of each benchmark model (docs/device.md's table): how many
launches took each path, per step, after warm-up (hot fusion groups compiled).

Usage: python -m benchmarks.paths [--steps N] [--threads T]
"""
from __future__ import annotations

import argparse
import sys

import torch

import torchneuron
from benchmarks.bench_device import MODELS, train_step
from benchmarks.common import sync, warm_up

COLUMNS = ("fast", "now", "host", "first_call", "queued_out", "queued_each", "queued_copy", "kernel", "compiled",
           "fused")


def step_paths(model: str, steps: int) -> dict[str, float]:
    """Launches per path per training step of MODELS[model] on neuron, after warm-up."""
    step = train_step("neuron", model)
    warm_up(step, 5)
    sync()
    torchneuron.clear_op_tracking()
    for _ in range(steps):
        step()
    sync()
    return {k: v / steps for k, v in torchneuron.get_execution_paths().items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"launches per training step ({args.threads} threads)\n")
    print("| model | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for model in MODELS:
        p = step_paths(model, args.steps)
        print(f"| {model} | " + " | ".join(f"{p[c]:g}" for c in COLUMNS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
