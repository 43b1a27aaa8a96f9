"""Speculative decoding: a small draft model proposes k tokens one decode step at a time, the served model checks
them in one forward over k + 1 new tokens and keeps the agreeing prefix plus one token of its own (Leviathan et
al., "Fast Inference from Transformers via Speculative Decoding", 2023). Each round's cost comes from two
estimates (the draft's decode step, the target's verification step); how many tokens a round yields depends on
how often the draft agrees with the target, which is a property of the two models and the text, not of the
hardware: it is an input here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import presets
from .estimate import EstimateResult, estimate


@dataclass(frozen=True)
class Speculative:
    """One speculation round: k draft decode steps and one verification step of the target, and what it yields."""

    draft: EstimateResult  # one decode step of the draft model
    verify: EstimateResult  # the target's forward over k + 1 new tokens after the cache
    k: int
    acceptance: float

    @property
    def tokens_per_round(self) -> float:
        """Expected tokens a round emits when each drafted token is accepted with probability `acceptance`
        (independently): 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
        a = self.acceptance
        return self.k + 1.0 if a == 1 else (1 - a ** (self.k + 1)) / (1 - a)

    @property
    def round_s(self) -> float:
        return self.k * self.draft.step_time_s + self.verify.step_time_s

    @property
    def tpot_s(self) -> float:
        """Time per output token (per sequence)."""
        return self.round_s / self.tokens_per_round

    def summary(self) -> str:
        return (f"speculative decoding, k={self.k}, acceptance {self.acceptance:.2f}: "
                f"{self.tokens_per_round:.2f} tokens per round of {self.round_s * 1e3:,.3f} ms "
                f"({self.k} draft steps of {self.draft.step_time_s * 1e3:,.3f} ms, verification "
                f"{self.verify.step_time_s * 1e3:,.3f} ms): TPOT {self.tpot_s * 1e3:,.3f} ms")


def speculative(model: torch.nn.Module, draft: torch.nn.Module, *, context: int, k: int, acceptance: float,
                batch: int = 1, draft_precision: str | None = None, **kw: Any) -> Speculative:
    """Cost speculative decoding of the Hugging Face causal LM `model` with `draft` proposing `k` tokens per round,
    each accepted with probability `acceptance`, after `context` cached tokens. Both run on the layout `kw`
    gives estimate() (target, instance, tp, dp, dtype, ...: fused speculation puts the draft on the target's
    cores); `precision` applies to the target, `draft_precision` to the draft."""
    if not 0 <= acceptance <= 1 or k < 1:
        raise ValueError(f"acceptance must be in [0, 1] and k >= 1, got acceptance={acceptance}, k={k}")
    kw = {"compare": None, **kw, "mode": "decode"}
    verify = estimate(model, presets.lm_inputs(model, mode="decode", context=context, batch=batch,
                                               new_tokens=k + 1), **kw)
    kw["precision"] = draft_precision
    drafted = estimate(draft, presets.lm_inputs(draft, mode="decode", context=context, batch=batch), **kw)
    return Speculative(drafted, verify, k, acceptance)
