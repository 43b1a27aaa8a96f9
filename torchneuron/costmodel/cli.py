"""`torchneuron estimate` and `torchneuron profile`: argument definitions and runners that torchneuron.cli
plugs in as subcommands, plus the demo's closing comparison."""
from __future__ import annotations

import argparse
import runpy
import sys
from typing import Any

import torch

from ..hardware.chips import CHIPS, GPU_INSTANCES, INSTANCES
from .estimate import EXECUTIONS, MODES, RECOMPUTE, EstimateResult, estimate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    from .presets import PRESETS

    p.add_argument("--model", default="gpt2-small",
                   help=f"{', '.join(PRESETS)} (Hugging Face configs, no weights), or "
                        "path/to/file.py:function returning (model, example_inputs) given batch, seq, mode")
    p.add_argument("--target", choices=sorted(CHIPS), default="trn2")
    p.add_argument("--instance", choices=sorted(INSTANCES), help="default: the target's largest instance")
    p.add_argument("--mode", choices=MODES, default="train")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (logical cores)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (logical cores)")
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank per micro-step")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (decode: tokens in the cache)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (gradient accumulation)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--lnc", type=int, help="logical NeuronCore size (trn2/trn3: 1 or 2)")
    p.add_argument("--execution", choices=EXECUTIONS, default="compiled")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--price", type=float, help="USD per instance-hour (default: the documented estimate)")
    p.add_argument("--compare", default="p5.48xlarge", choices=[*GPU_INSTANCES, "none"])
    p.add_argument("--report", metavar="OUT.md|OUT.html", help="also write a report with charts")
    p.add_argument("--top", type=int, default=10, help="ops to list")


def _ops_table(r: EstimateResult, n: int) -> str:
    rows = [f"  {'op':<44} {'engine':<10} {'ms/step':>10} {'calls':>7}  {'bound':<13} {'achieved':>8}"]
    rows += [f"  {op[:44]:<44} {eng:<10} {t * 1e3:>10.3f} {calls:>7}  {bound:<13} {a:>8.0%}"
             for op, eng, t, bound, a, calls in r.top(n)]
    return "\n".join(rows)


def run_estimate(a: argparse.Namespace) -> int:
    from . import presets, report

    model, inputs = presets.load(a.model, batch=a.batch, seq=a.seq, mode=a.mode, dtype=DTYPES[a.dtype])
    tokens = a.global_batch * (a.seq if a.mode == "train" else 1) if a.global_batch else None
    r = estimate(model, inputs, target=a.target, instance=a.instance, mode=a.mode, dp=a.dp, tp=a.tp,
                 dtype=DTYPES[a.dtype], batch_tokens=tokens, price_per_hour=a.price, lnc=a.lnc,
                 execution=a.execution, recompute=a.recompute,
                 compare=None if a.compare == "none" else a.compare)
    print(f"{a.model}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, batch {a.batch} x "
          f"{'context ' if a.mode == 'decode' else ''}{a.seq}, {a.dtype}")
    print(r.summary())
    if r.comparison:
        print(r.comparison.summary())
    print(f"top ops on one {r.target} core:\n{_ops_table(r, a.top)}")
    if a.report:
        for path in report.write(r, a.report, a.model):
            print(f"wrote {path}")
    return 0


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="a Python script to run under the profiler")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.add_argument("--device", default="neuron", help="record ops on this device type ('all': every device)")
    p.add_argument("--target", choices=sorted(CHIPS), help="chip to model (default: the configured one)")
    p.add_argument("--trace", default="torchneuron_trace.json", help="Chrome / Perfetto trace to write")
    p.add_argument("--top", type=int, default=20, help="ops in the summary table")


def run_profile(a: argparse.Namespace) -> int:
    from ..profiler import profile

    argv = sys.argv
    sys.argv = [a.script, *a.args]
    try:
        with profile(device=None if a.device == "all" else a.device, target=a.target) as prof:
            runpy.run_path(a.script, run_name="__main__")
    finally:
        sys.argv = argv
    print(prof.summary(a.top))
    print(f"wrote {prof.export_chrome_trace(a.trace)} (open in https://ui.perfetto.dev)")
    return 0


def demo_estimate_text(model: torch.nn.Module, example_inputs: Any) -> str:
    """A few lines for the demo: one training step of `model` on a trn2 NeuronCore and on an H100."""
    r = estimate(model, example_inputs, target="trn2", compare="p5.48xlarge")
    n = sum(p.numel() for p in model.parameters())
    lines = [f"Modelled training step of the demo model ({n / 1e6:.2f}M parameters, {r.items_per_step:,.0f} "
             f"{r.unit} per step, compiled):"]
    for e in (r, r.comparison):
        where = f"1 {e.target} {'NeuronCore' if e.target.startswith('trn') else 'GPU'} of {e.instance}"
        lines.append(f"  {where:<32} {e.step_time_s * 1e3:8.3f} ms  {e.items_per_s:>12,.0f} {e.unit}/s  "
                     f"MFU {e.mfu:5.1%}  ${e.cost_per_million:,.4f} per million {e.unit}")
    lines.append("  (prices are documented estimates; larger models: torchneuron estimate --model llama-8b)")
    return "\n".join(lines)
