"""`torchneuron estimate`: argument definitions and a runner that torchneuron.cli plugs in as a subcommand, the
argparse types `torchneuron profile` shares (profiler/cli.py), and the demo's closing comparison."""
from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ..hardware.chips import (
    CHIPS,
    GPU_INSTANCES,
    GPUS,
    INSTANCES,
    LARGEST_INSTANCE,
    PRICING,
    gpu_instance,
    hourly_rate,
    rated_instances,
)
from .estimate import EXECUTIONS, MODES, PRECISIONS, RECOMPUTE, SCHEDULES, EstimateError, EstimateResult, estimate
from .validation import moe_caveat

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= lo (a usage error naming the range otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value
    return parse


def positive_finite(text: str) -> float:
    """An argparse type: a finite number > 0 (nan, inf, 0 and negative prices are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    from .presets import PRESETS

    p.add_argument("--model", default="gpt2-small",
                   help=f"{', '.join(PRESETS)} (Hugging Face configs, no weights), or "
                        "path/to/file.py:function returning (model, example_inputs) given batch, seq, mode")
    p.add_argument("--target", choices=sorted(CHIPS), default="trn2")
    p.add_argument("--instance", choices=sorted(INSTANCES), help="default: the target's largest instance")
    p.add_argument("--mode", choices=MODES, default="train")
    p.add_argument("--dp", type=at_least(1), default=1, help="data-parallel degree (logical cores, >= 1)")
    p.add_argument("--tp", type=at_least(1), default=1,
                   help="tensor-parallel degree (logical cores of one instance: 1 to the instance's cores)")
    p.add_argument("--batch", type=at_least(1), default=1, help="sequences per data-parallel rank per micro-step")
    p.add_argument("--seq", type=at_least(1), default=1024,
                   help="sequence length (decode: tokens in the cache), at most the model's context")
    p.add_argument("--global-batch", type=at_least(1),
                   help="sequences per optimizer step (gradient accumulation), at least dp x batch")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--lnc", type=int, help="logical NeuronCore size (trn2/trn3: 1 or 2)")
    p.add_argument("--execution", choices=EXECUTIONS, default="compiled")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--price", type=positive_finite,
                   help="USD per instance-hour, > 0 (default: the documented estimate)")
    p.add_argument("--pricing", choices=PRICING, default="on-demand",
                   help="how both sides' instance-hours are bought: reserved (AWS's RI-effective rate: trn1) or "
                        "capacity-block (EC2 Capacity Blocks: trn1.32xlarge, p5.48xlarge, p5e.48xlarge); a usage "
                        "error where no rate is published (docs/hardware.md, Prices)")
    p.add_argument("--precision", choices=[x for x in PRECISIONS if x],
                   help="fp8: matmuls in fp8 (MFU on the fp8 peak); w8: 8-bit weights, 16-bit math (inference)")
    p.add_argument("--pp", type=at_least(1), default=1, help="pipeline stages (layers split evenly)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    p.add_argument("--vpp", type=at_least(1), default=1, help="virtual stages per core (--schedule interleaved)")
    p.add_argument("--fsdp", action="store_true", help="ZeRO-3: weights and gradients sharded over --dp too")
    p.add_argument("--speculate", type=at_least(1), metavar="K",
                   help="decode: speculative decoding, --draft proposing K tokens per round (needs --acceptance)")
    p.add_argument("--draft", help="the draft model for --speculate (a preset, e.g. llama-1b, or file.py:function)")
    p.add_argument("--acceptance", type=float,
                   help="--speculate: probability that the target accepts each drafted token, in [0, 1]")
    p.add_argument("--ep", type=at_least(1), default=1,
                   help="expert parallelism (MoE models): experts split over this many of the --dp replicas")
    p.add_argument("--compare", default="p5.48xlarge", choices=[*GPU_INSTANCES, "none"],
                   help="the GPU instance to compare with (--gpu names the GPU instead)")
    p.add_argument("--gpu", choices=[*GPUS, "none"],
                   help="compare with this GPU on its instance type (default: --compare's, an H100)")
    p.add_argument("--gpu-count", type=at_least(1), help="GPUs of the comparison job (default: the cheapest "
                   "layout that fits and, serving, is as fast as the Trainium step)")
    p.add_argument("--gpu-tp", type=at_least(1), help="tensor-parallel degree on the GPUs (1..8)")
    p.add_argument("--gpu-dtype", choices=["same", "bf16", "fp8", "w8"], default="same",
                   help="GPU matmul precision: same as the Trainium run (default), bf16, fp8 or w8")
    p.add_argument("--gpu-price", type=positive_finite, help="USD per GPU-instance-hour (default: documented)")
    p.add_argument("--report", metavar="OUT.md|OUT.html", help="also write a report with charts")
    p.add_argument("--from-profile", metavar="TRACE.json",
                   help="price the op mix torchneuron.profiler recorded (torchneuron profile --trace) on --target "
                        "and the GPU instead of a --model")
    p.add_argument("--profile-steps", type=at_least(1), default=1,
                   help="--from-profile: steps (or requests) the profile covers; times are per step")
    p.add_argument("--search", action="store_true",
                   help="search the cheapest Trainium and GPU configurations meeting a --target-* and print the "
                        "frontier (instances, tp, pp, dp, precision; serving: batch sizes)")
    p.add_argument("--target-tokens-per-s", type=positive_finite, help="--search, training: tokens/s to reach")
    p.add_argument("--target-tpot-ms", type=positive_finite, help="--search, decode: time per output token")
    p.add_argument("--target-ttft-ms", type=positive_finite, help="--search, forward: time to first token")
    p.add_argument("--search-batches", default="1,4,16,64",
                   help="--search, serving: comma-separated batch sizes to try (default 1,4,16,64)")
    p.add_argument("--top", type=at_least(0), default=10, help="ops to list (>= 0)")


def check_estimate_arguments(a: argparse.Namespace, error: Callable[[str], Any]) -> None:
    """The checks that involve several arguments; `error` is the parser's (a usage error, exit status 2)."""
    from .estimate import Layout
    from .presets import PRESETS, check_spec

    try:
        lay = Layout.of(a.target, a.instance, a.lnc)
    except ValueError as e:
        error(f"{e} (--target {a.target}, --instance {a.instance or 'default'}, --lnc {a.lnc or 'default'})")
    try:
        lay.check_tp(a.tp)
    except ValueError as e:
        error(f"--tp: {e}")
    if a.gpu_tp is not None and not 1 <= a.gpu_tp <= 8:
        error(f"--gpu-tp must be in 1..8 (the GPUs of one instance), got {a.gpu_tp}")
    if a.gpu_count and a.gpu_tp and a.gpu_count % a.gpu_tp:
        error(f"--gpu-count ({a.gpu_count}) must be a multiple of --gpu-tp ({a.gpu_tp})")
    if a.precision == "w8" and a.mode == "train":
        error("--precision w8 (8-bit weights) is for inference: use --precision fp8 to train in fp8")
    if a.search:
        targets = {"train": a.target_tokens_per_s, "decode": a.target_tpot_ms, "forward": a.target_ttft_ms}
        flag = {"train": "--target-tokens-per-s", "decode": "--target-tpot-ms", "forward": "--target-ttft-ms"}
        if targets[a.mode] is None:
            error(f"--search --mode {a.mode} needs {flag[a.mode]}")
        try:
            a.search_batches = sorted({int(x) for x in a.search_batches.split(",")})
        except ValueError:
            a.search_batches = []
        if not a.search_batches or min(a.search_batches) < 1:
            error("--search-batches: comma-separated integers >= 1, e.g. 1,4,16")
    if a.pricing != "on-demand":
        _apply_pricing(a, error)
    if a.vpp > 1 and a.schedule != "interleaved":
        error("--vpp needs --schedule interleaved")
    if a.fsdp and a.mode != "train":
        error("--fsdp shards training state: use it with --mode train")
    for flag, spec in (("--model", a.model), ("--draft", a.draft)):
        try:
            if spec is not None and not (flag == "--model" and a.from_profile):
                check_spec(spec, flag)
        except ValueError as e:
            error(str(e))
    if a.speculate is not None or a.draft is not None or a.acceptance is not None:
        if a.mode != "decode" or a.speculate is None or a.draft is None or a.acceptance is None:
            error("speculative decoding needs --mode decode, --speculate K, --draft MODEL and --acceptance A")
        if not 0 <= a.acceptance <= 1:
            error(f"--acceptance must be in [0, 1], got {a.acceptance}")
    if a.dp % a.ep:
        error(f"--ep must divide --dp (experts are split over data-parallel replicas), got --ep {a.ep} --dp {a.dp}")
    if a.global_batch is not None and a.global_batch < a.dp * a.batch:
        error(f"--global-batch must be at least --dp x --batch = {a.dp * a.batch}, got {a.global_batch}")
    if a.from_profile:
        if not os.path.isfile(a.from_profile):
            error(f"--from-profile {a.from_profile!r}: no such file")
        return
    if a.model in PRESETS:
        kw = PRESETS[a.model][1]
        context = kw.get("n_positions") or kw.get("max_position_embeddings")
        if context and a.seq > context:
            error(f"--seq must be in 1..{context} for {a.model} (its context length), got {a.seq}")
    else:
        path, _, fn = a.model.rpartition(":")
        if not (path and fn and os.path.isfile(path)):
            error(f"--model {a.model!r}: use one of {', '.join(PRESETS)} or path/to/file.py:function")
    if a.report and not os.path.isdir(os.path.dirname(os.path.abspath(a.report))):
        error(f"--report {a.report!r}: its directory does not exist")


def _apply_pricing(a: argparse.Namespace, error: Callable[[str], Any]) -> None:
    """--pricing reserved | capacity-block: the Trainium instance and the compared GPU instance both at that kind
    of rate (a buyer compares like with like; --price / --gpu-price override a side). An H200 is bought on the
    instance that kind of rate is published for. A usage error names an instance without a published rate."""
    def rate(instance: str, flag: str) -> float:
        r = hourly_rate(instance, a.pricing)
        if r is None:
            error(f"--pricing {a.pricing}: no {a.pricing} rate is published for {instance} (published for: "
                  f"{', '.join(rated_instances(a.pricing))}); pass {flag}")
        return r

    if a.price is None:
        a.price = rate(a.instance or LARGEST_INSTANCE[a.target], "--price")
    gpu = a.gpu or a.compare
    if a.search or gpu == "none":  # --search prices each GPU instance itself and leaves out those without a rate
        return
    instance = gpu_instance(gpu, a.pricing) if gpu in GPUS else gpu
    if a.gpu_price is None:
        a.gpu_price = rate(instance, "--gpu-price (or --gpu none)")
    a.gpu, a.compare = None, instance


def _ops_table(r: EstimateResult, n: int) -> str:
    rows = [f"  {'op':<44} {'engine':<10} {'ms/step':>10} {'calls':>7}  {'bound':<13} {'achieved':>8}"]
    rows += [f"  {op[:44]:<44} {eng:<10} {t * 1e3:>10.3f} {calls:>7}  {bound:<13} {a:>8.0%}"
             for op, eng, t, bound, a, calls in r.top(n)]
    return "\n".join(rows)


def buyer_table(r: EstimateResult) -> str:
    """Trainium beside the GPU job as a buyer compares them: layout, time, $/hour, $/million items, and the
    ratio of the two costs per item."""
    c = r.comparison
    per = "time per token" if r.mode == "decode" else "step time"
    money = lambda x, d=2: "n/a" if x is None else f"${x:,.{d}f}"
    rows = [(f"{r.cores} x {r.target} ({r.instance})", r), (f"{c.cores} x {c.target} ({c.instance})", c)]
    lines = [f"  {'':<34} {per:>14} {'$/hour':>10} {'$/M ' + r.unit:>14}  layout"]
    for name, e in rows:
        lines.append(f"  {name:<34} {e.step_time_s * 1e3:>11,.2f} ms {money(e.cost_per_hour):>10} "
                     f"{money(e.cost_per_million, 4):>14}  dp={e.dp} tp={e.tp}{f' pp={e.pp}' if e.pp > 1 else ''} "
                     f"{e.precision or 'as traced'}{'' if e.fits else '  DOES NOT FIT'}")
    if not (r.fits and c.fits):  # a job that does not fit has no cost to compare
        lines.append("  no cost ratio: " + " and ".join(
            f"the {side} job does not fit in memory" for side, e in (("Trainium", r), ("GPU", c)) if not e.fits))
    elif r.cost_per_million and c.cost_per_million:
        lines.append(f"  Trainium / GPU cost per {r.unit[:-1]}: {r.cost_per_million / c.cost_per_million:.2f}x")
    return "\n".join(lines)


def run_estimate(a: argparse.Namespace) -> int:
    from . import presets, report

    error = a.parser.error if "parser" in a else usage_error
    check_estimate_arguments(a, error)
    if a.search:
        return run_search(a)
    if a.from_profile:
        return run_from_profile(a)
    tokens = a.global_batch * (a.seq if a.mode == "train" else 1) if a.global_batch else None
    compare = a.gpu if a.gpu else a.compare
    gpu_dtype = {"same": "same", "bf16": None}.get(a.gpu_dtype, a.gpu_dtype)
    try:
        # decode: --seq tokens are in the cache (its attention reads and its memory)
        model, inputs = presets.load(a.model, batch=a.batch, seq=a.seq, mode=a.mode, dtype=DTYPES[a.dtype],
                                     context=a.seq if a.mode == "decode" else 0)
        r = estimate(model, inputs, target=a.target, instance=a.instance, mode=a.mode, dp=a.dp, tp=a.tp,
                     dtype=DTYPES[a.dtype], batch_tokens=tokens, price_per_hour=a.price, lnc=a.lnc,
                     execution=a.execution, recompute=a.recompute, precision=a.precision, fsdp=a.fsdp,
                     pp=a.pp, schedule=a.schedule, vpp=a.vpp, ep=a.ep,
                     compare=None if compare == "none" else compare, gpu_count=a.gpu_count, gpu_tp=a.gpu_tp,
                     gpu_precision=gpu_dtype, gpu_price=a.gpu_price)
    except torch.OutOfMemoryError as e:
        print(f"torchneuron estimate: {e}")
        return 1
    except EstimateError as e:  # a layout the model cannot take (--ep on a model without experts, ...)
        error(str(e))
    print(f"{a.model}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, batch {a.batch} x "
          f"{'context ' if a.mode == 'decode' else ''}{a.seq}, {a.dtype}")
    if a.pricing != "on-demand":
        print(f"prices: {a.pricing} rates on both sides (docs/hardware.md, Prices)")
    print(r.summary())
    if caveat := moe_caveat(r):
        print(f"  {caveat}")
    if r.comparison:
        print(r.comparison.summary())
        print(buyer_table(r))
    print(f"top ops on one {r.target} core:\n{_ops_table(r, a.top)}")
    if a.speculate:
        _print_speculation(a, model, r)
    if a.report:
        for path in report.write(r, a.report, a.model):
            print(f"wrote {path}")
    return 0


def _print_speculation(a: argparse.Namespace, model: torch.nn.Module, r: EstimateResult) -> None:
    """--speculate: the same decode with a draft model, on the Trainium layout and on the compared GPU one."""
    from .presets import load
    from .speculative import speculative

    draft = load(a.draft, mode="decode", dtype=DTYPES[a.dtype], flag="--draft")[0]
    kw = dict(context=a.seq, k=a.speculate, acceptance=a.acceptance, batch=a.batch, dtype=DTYPES[a.dtype])
    runs = [(r, speculative(model, draft, target=a.target, instance=a.instance, lnc=a.lnc, tp=a.tp, dp=a.dp,
                            precision=a.precision, **kw))]
    if r.comparison:
        c = r.comparison
        runs.append((c, speculative(model, draft, target=c.instance, tp=c.tp, dp=c.dp, precision=c.precision,
                                    **kw)))
    for e, s in runs:
        print(f"{e.cores} x {e.target}: {s.summary()} (without: {e.step_time_s * 1e3:,.3f} ms)")


def run_from_profile(a: argparse.Namespace) -> int:
    """--from-profile: the recorded op mix on the target's core and on one GPU, eager and compiled."""
    from . import mix

    try:
        ops = mix.load(a.from_profile, steps=a.profile_steps)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"torchneuron estimate: {e}")
        return 1
    gpu = None if a.gpu == "none" or a.compare == "none" else (a.gpu or a.compare)
    costs = [mix.price(ops, a.target, lnc=a.lnc, execution=x, price_per_hour=a.price) for x in ("eager", "compiled")]
    if gpu:
        costs += [mix.price(ops, gpu, execution=x, price_per_hour=a.gpu_price) for x in ("eager", "compiled")]
    calls = sum(o.calls for o in ops)
    print(f"{a.from_profile}: {calls:,} ops per step ({len(ops)} kinds) recorded by torchneuron.profiler, re-priced")
    print(mix.table(costs))
    return 0


def run_search(a: argparse.Namespace) -> int:
    """--search: every fitting configuration on the target's largest instance and on each priced GPU instance."""
    from . import presets, search

    def build(batch: int) -> tuple[torch.nn.Module, Any]:
        return presets.load(a.model, batch=batch, seq=a.seq, mode=a.mode, dtype=DTYPES[a.dtype],
                            context=a.seq if a.mode == "decode" else 0)

    gpus = [] if a.gpu == "none" else [a.gpu] if a.gpu else list(GPUS)
    prices = {a.gpu: a.gpu_price} if a.gpu and a.gpu_price else {}
    latency = {"decode": a.target_tpot_ms, "forward": a.target_ttft_ms}.get(a.mode)
    cands = search.search(build, mode=a.mode, target=a.target, gpus=gpus,
                          batches=[a.batch] if a.mode == "train" else a.search_batches,
                          tokens_per_s=a.target_tokens_per_s if a.mode == "train" else None,
                          latency_s=latency / 1e3 if latency else None, dtype=DTYPES[a.dtype],
                          global_batch_tokens=a.global_batch * a.seq if a.global_batch else None,
                          gpu_prices=prices, pricing=a.pricing, trainium_price=a.price)
    goal = (f"{a.target_tokens_per_s:,.0f} tokens/s" if a.mode == "train" else
            f"{latency:g} ms {'per output token' if a.mode == 'decode' else 'to first token'}")
    print(f"{a.model}, {a.mode}, seq {a.seq}: configurations meeting {goal} (* meets it), prices {a.pricing}")
    print(search.table(cands))
    return 0


def usage_error(message: str) -> None:
    raise ValueError(message)


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
