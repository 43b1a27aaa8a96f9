"""`make demo`: train a small GPT and a CNN on the `neuron` device next to the CPU, then estimate Trainium cost.

It shows, in a minute, what a new user gets: unchanged PyTorch code running on `neuron`, losses that track the
CPU's step for step (within TOLERANCE by default; bit for bit under torch.use_deterministic_algorithms(True), checked
last), memory and op statistics from the device, and what the step would cost on real hardware.
"""
from __future__ import annotations

import copy
import sys
import time

import torch

import torchneuron
from torchneuron.models import GPTConfig, SmallCNN, TinyGPT, gpt_batch, image_batch, train_steps

STEPS = 20
EXACT_STEPS = 5
# By default the device trades the last bits for speed (docs/device.md: a small kernel runs with one thread fewer
# when the threads fill the cores, so its reduction splits otherwise; fused kernels round within an ulp): each loss
# is within this relative distance of the CPU's at any core count.
TOLERANCE = 1e-3


def _bar(label: str, step: int, total: int, loss: float, width: int = 28) -> None:
    if sys.stdout.isatty() or step + 1 == total:  # redraw in a terminal; one line per run in a log
        done = int(width * (step + 1) / total)
        bar = "#" * done + "." * (width - done)
        sys.stdout.write(f"\r  {label:<17} [{bar}] {step + 1:>2}/{total}  loss {loss:7.4f}")
        sys.stdout.flush()


def _run(name: str, model: torch.nn.Module, batches, device: str) -> tuple[list[float], float]:
    train_steps(copy.deepcopy(model), batches(), device, 2)  # warm-up: first-call costs are not the device's
    t0 = time.perf_counter()
    losses = train_steps(copy.deepcopy(model), batches(), device, STEPS,
                         on_step=lambda s, loss: _bar(f"{name}@{device}", s, STEPS, loss))
    print()
    return losses, time.perf_counter() - t0


def _exact_losses(name: str, model: torch.nn.Module, batches) -> bool:
    """Deterministic mode: every kernel with the CPU's thread count and no fusion, so the losses are the CPU's bits."""
    torch.use_deterministic_algorithms(True)
    try:
        cpu = train_steps(copy.deepcopy(model), batches(), "cpu", EXACT_STEPS)
        return cpu == train_steps(copy.deepcopy(model), batches(), "neuron", EXACT_STEPS)
    finally:
        torch.use_deterministic_algorithms(False)


def main() -> None:
    props = torch.neuron.get_device_properties(0)
    print(f"torchneuron {torchneuron.__version__} | torch {torch.__version__}")
    print(f"device: {torch.neuron.device_count()} x {props.name}, {props.total_memory >> 30} GiB each "
          f"({props.instance}, LNC={props.physical_cores})\n")
    # Without dropout: the neuron generator is counter-based (Philox, like CUDA's) and draws other masks than the
    # CPU's mt19937, so only dropout-free training can match the CPU step for step.
    cfg = GPTConfig(dropout=0.0)
    torch.manual_seed(0)
    cnn = SmallCNN()
    cnn.head[1].p = 0.0
    workloads = [
        ("tiny-gpt", TinyGPT(cfg), lambda: (gpt_batch(cfg, 8, torch.Generator().manual_seed(i)) for i in range(STEPS))),
        ("small-cnn", cnn, lambda: (image_batch(16, torch.Generator().manual_seed(i)) for i in range(STEPS))),
    ]
    rows = []
    for name, model, batches in workloads:
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, {STEPS} AdamW steps")
        cpu, t_cpu = _run(name, model, batches, "cpu")
        torchneuron.clear_op_tracking()
        torch.neuron.reset_peak_memory_stats()
        dev, t_dev = _run(name, model, batches, "neuron")
        rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(cpu, dev, strict=True))
        rows.append((name, dev[0], dev[-1], rel, t_dev / t_cpu, torch.neuron.max_memory_allocated(),
                     sum(torchneuron.get_executed_ops().values()), sum(torchneuron.get_fallback_ops().values())))
    print(f"\nsummary (losses vs the CPU's: largest relative difference over {STEPS} steps, at most {TOLERANCE:g})")
    print(f"  {'model':<10} {'first loss':>10} {'last loss':>10} {'vs cpu':>8} {'time/cpu':>9} {'peak mem':>9} "
          f"{'device ops':>10} {'fallbacks':>9}")
    for name, first, last, rel, ratio, peak, ops, fb in rows:
        print(f"  {name:<10} {first:>10.4f} {last:>10.4f} {rel:>8.1e} {ratio:>8.2f}x "
              f"{peak / 2**20:>7.1f}MB {ops:>10,} {fb:>9}")
    exact = _exact_losses(*workloads[0])
    print(f"\nbit-exact mode (torch.use_deterministic_algorithms(True)): {workloads[0][0]}, {EXACT_STEPS} steps, "
          f"losses identical to the CPU's: {'yes' if exact else 'NO'}")
    try:
        from torchneuron.costmodel.cli import demo_estimate_text
    except ImportError as e:  # the cost model is optional for the device demo
        print(f"\n(cost estimate unavailable: {e})")
        return
    idx, _ = gpt_batch(cfg, 8, torch.Generator().manual_seed(0))
    print("\n" + demo_estimate_text(TinyGPT(cfg), (idx,)))
    if any(r[3] > TOLERANCE for r in rows) or not exact:
        sys.exit(f"losses on neuron differ from the CPU's (by more than {TOLERANCE:g}, or not bit for bit in "
                 "deterministic mode)")


if __name__ == "__main__":
    main()
