"""`torchneuron estimate --search`: the cheapest Trainium and GPU configurations that meet a target (tokens/s for
training; time per token or time to first token for serving), and the frontier of cost against speed.

Each batch size is traced once; every layout (instance type, tensor- and pipeline-parallel degree, data-parallel
replicas, expert parallelism for MoE models, precision) is then costed from that trace with estimate.cost, and
skipped when it does not fit (estimate.fit_error). Cost per million tokens is the instance price pro rata for the
cores used.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..hardware.chips import GPUS, LARGEST_INSTANCE, gpu_instance, hourly_rate
from .estimate import EstimateResult, Layout, Plan, cost, experts, fit_error
from .trace import Trace, trace


@dataclass(frozen=True)
class Candidate:
    """One configuration and its modelled step."""

    platform: str  # trainium | gpu
    layout: str  # e.g. "trn2.48xlarge x1, tp=8 pp=1 dp=2, bf16, batch 4"
    batch: int
    result: EstimateResult
    meets: bool

    @property
    def cost_per_million(self) -> float:
        return self.result.cost_per_million if self.result.cost_per_million is not None else math.inf


def _layouts(lay: Layout, train: bool) -> list[tuple[int, int]]:
    """(tp, pp) pairs: tensor parallelism in powers of two inside an instance; pipelines of 1-8 stages when
    training."""
    tps = [2**k for k in range(12) if 2**k <= lay.cores_per_instance]
    return [(t, p) for t in tps for p in ((1, 2, 4, 8) if train else (1,))]


def _expert_degrees(tr: Trace, lay: Layout, tp: int) -> list[int]:
    """1, and for an MoE model every power of two that divides its experts per layer with ep x tp cores inside
    one instance (expert-parallel ranks are next to each other, pipeline stages outermost: the all-to-alls stay on
    the fabric)."""
    n = experts(tr).per_layer
    return [1] + [e for e in (2**k for k in range(1, 12)) if n and n % e == 0 and e * tp <= lay.cores_per_instance]


def _precisions(train: bool) -> tuple[str | None, ...]:
    return (None, "fp8") if train else (None, "w8", "fp8")


def _meets(r: EstimateResult, tokens_per_s: float | None, latency_s: float | None) -> bool:
    if tokens_per_s is not None and r.items_per_s < tokens_per_s:
        return False
    return latency_s is None or r.step_time_s <= latency_s


def search(build: Callable[[int], tuple[torch.nn.Module, Any]], *, mode: str, target: str = "trn2",
           gpus: Sequence[str] = ("h100",), batches: Sequence[int] = (1,), tokens_per_s: float | None = None,
           latency_s: float | None = None, dtype: torch.dtype = torch.bfloat16,
           global_batch_tokens: float | None = None, gpu_prices: dict[str, float] | None = None,
           pricing: str = "on-demand", trainium_price: float | None = None) -> list[Candidate]:
    """Every fitting configuration on `target`'s largest instance and on each GPU's instance, costed.

    build(batch) -> (model, example_inputs). Training: `tokens_per_s` is the target; data-parallel replicas are
    added until it is met (at most 4,096 cores). Serving: `latency_s` bounds the step (a decode step is the time
    per output token, a forward pass the time to first token); each batch size in `batches` is a candidate.
    Every platform is priced as `pricing` (hardware.chips.PRICING) unless `trainium_price` / `gpu_prices` (by GPU
    or instance name) give its rate; a GPU instance without a rate is left out."""
    train = mode == "train"
    tlay = Layout.of(target, LARGEST_INSTANCE[target])
    tprice = trainium_price if trainium_price is not None else hourly_rate(tlay.instance, pricing)
    platforms = [("trainium", replace(tlay, price_per_hour=tprice))]
    prices = gpu_prices or {}
    for g in gpus:
        name = gpu_instance(g, pricing) if g in GPUS else g
        price = prices.get(g, prices.get(name, hourly_rate(name, pricing)))
        if price is None:
            continue  # no price: cost per token unknown; pass a price to include it
        platforms.append(("gpu", replace(Layout.of(name), price_per_hour=price)))
    out: list[Candidate] = []
    for batch in batches:
        model, inputs = build(batch)
        tr = trace(model, inputs, train=train, dtype=dtype)
        for platform, lay in platforms:
            for tp, pp in _layouts(lay, train):
                for ep in _expert_degrees(tr, lay, tp):
                    for precision in _precisions(train):
                        out += _configs(tr, lay, platform, batch, mode, tp, pp, precision, tokens_per_s,
                                        latency_s, global_batch_tokens, ep)
    return out


def _configs(tr: Trace, lay: Layout, platform: str, batch: int, mode: str, tp: int, pp: int,
             precision: str | None, tokens_per_s: float | None, latency_s: float | None,
             global_batch_tokens: float | None, ep: int = 1) -> list[Candidate]:
    train = mode == "train"
    micro = 4 * pp if pp > 1 else 1  # enough micro-batches to keep a pipeline's bubble small

    def plan(dp: int) -> Plan:
        tokens = global_batch_tokens or tr.items * dp * micro
        return Plan(mode, dp, tp, tokens if train else None, None, "compiled", "selective" if train else "none",
                    "adamw" if train else None, True, precision, False, pp, ep=ep)

    dp = ep  # expert parallelism splits the experts over ep data-parallel replicas
    if fit_error(tr, lay, plan(dp)) is not None:
        return []
    r = cost(tr, lay, plan(dp))
    if train and tokens_per_s:
        for _ in range(4):  # data-parallel replicas to the target (the gradient sync grows with dp: re-cost)
            need = math.ceil(tokens_per_s / (r.items_per_s / dp) / ep - 1e-9) * ep
            if need <= dp or need * tp * pp > 4096:
                break
            dp = need
            r = cost(tr, lay, plan(dp))
    prec = precision or "bf16"
    text = (f"{lay.instance} x{r.instances}, tp={tp}" + (f" pp={pp}" if pp > 1 else "") + f" dp={dp}"
            + (f" ep={ep}" if ep > 1 else "") + f", {prec}" + ("" if train else f", batch {batch}"))
    return [Candidate(platform, text, batch, r, _meets(r, tokens_per_s, latency_s))]


def frontier(cands: Sequence[Candidate]) -> list[Candidate]:
    """Pareto frontier of (cost per million tokens, step time): no other candidate is both cheaper and faster.
    Sorted cheapest first."""
    speed = lambda c: c.result.step_time_s
    ranked = sorted(cands, key=lambda c: (c.cost_per_million, speed(c)))
    out, best = [], math.inf
    for c in ranked:
        if speed(c) < best:
            out.append(c)
            best = speed(c)
    return out


def table(cands: Sequence[Candidate]) -> str:
    """Per platform: the cheapest configuration meeting the target, then the frontier."""
    lines = []
    for platform in ("trainium", "gpu"):
        mine = [c for c in cands if c.platform == platform]
        if not mine:
            lines.append(f"{platform}: no configuration fits (or no price: pass --gpu-price)")
            continue
        ok = [c for c in mine if c.meets]
        best = min(ok, key=lambda c: c.cost_per_million) if ok else None
        lines.append(f"{platform}: " + (f"cheapest meeting the target: {_row(best)}" if best else
                                        "no configuration meets the target"))
        lines.append(f"  frontier ({len(mine)} configurations fit):")
        lines += [f"  {'*' if c.meets else ' '} {_row(c)}" for c in frontier(mine)]
    return "\n".join(lines)


def _row(c: Candidate) -> str:
    r = c.result
    what = "step" if r.mode == "train" else ("per token" if r.mode == "decode" else "prefill")
    return (f"{c.layout}: {r.step_time_s * 1e3:,.2f} ms {what}, {r.items_per_s:,.0f} {r.unit}/s, "
            f"${r.cost_per_hour:,.2f}/h, ${c.cost_per_million:,.4f}/M {r.unit}")

