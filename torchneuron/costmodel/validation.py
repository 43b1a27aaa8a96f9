"""The cost model against published Trainium measurements, with one set of constants (hardware/chips.py) for
every case. docs/costmodel.md shows the table; tests/test_costmodel_validation.py recomputes it.

Sources (aws-neuron/aws-neuron-sdk documentation, see docs/hardware.md): S25 the NKI matmul tutorial
(docs commit 82231d6), S40 tools/neuron-sys-tools/nccom-test.rst, S26
about-neuron/benchmarks/trn1/training_data_{decoder,encoder}.csv, S27
libraries/nxd-inference/tutorials/trn2-llama3.3-70b-tutorial.rst, S28 the 405B speculative-decoding
tutorial next to it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import presets
from .estimate import Layout, estimate
from .ops import op_cost

BOUND = 0.30  # the aim: |modelled / published - 1| <= 30% on every case


@dataclass(frozen=True)
class Case:
    name: str
    setup: str
    metric: str
    published: float
    source: str
    run: Callable[[], float]


def _matmul() -> float:
    """S25: the tutorial's fully optimised kernel, one NeuronCore-v2, P99 of nki.benchmark."""
    c = op_cost("mm", [((4096, 8192), "bfloat16"), ((8192, 8192), "bfloat16")], [((4096, 8192), "bfloat16")],
                "trn1", mode="kernel")
    return c.time_s * 1e3


def _llama8b_train() -> float:
    """S26: Llama-3.1-8B pre-training, 32 trn1.32xlarge, TP=32 DP=32 ZeRO-1, micro-batch 1, global batch 1024,
    seq 8192, BF16 autocast, AdamW; the NxD tutorial's sequence parallelism and selective (attention)
    recomputation."""
    model = presets.hf_model(presets.config("llama-8b"))
    r = estimate(model, presets.lm_inputs(model, seq=8192), target="trn1", instance="trn1.32xlarge", tp=32,
                 dp=32, dtype=torch.bfloat16, batch_tokens=1024 * 8192, recompute="selective", compare=None)
    return r.items_per_s / 8192


def _bert_large_train() -> float:
    """S26: HuggingFace BERT-Large phase-1 pre-training, one trn1.32xlarge, 32 cores data parallel,
    micro-batch 16, seq 128, global batch 16384, BF16 autocast, AdamW (LAMB in the multi-node row)."""
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    ids = torch.zeros(16, 128, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids, "next_sentence_label": torch.zeros(16, dtype=torch.long)}
    r = estimate(model, inputs, target="trn1", instance="trn1.32xlarge", dp=32, dtype=torch.bfloat16,
                 batch_tokens=16384 * 128, compare=None)
    return r.items_per_s / 128


def _allreduce_two_instances() -> float:
    """S40: nccom-test all-reduce of 1 GiB (fp32) over 64 ranks on two trn1.32xlarge (the intra-instance
    efficiency in chips.py comes from a different row of the same page: 2 ranks, one instance)."""
    return Layout.of("trn1.32xlarge").collective("all_reduce", 2**30, 64).time_s * 1e3


def _decode(name: str, context: int) -> float:
    """Batch 1, BF16, TP=64 at LNC=2 on one trn2.48xlarge, 10,000 input tokens and ~1,500-1,800 generated:
    the cache holds the prompt plus half the generated tokens on average."""
    model = presets.hf_model(presets.config(name))
    r = estimate(model, presets.lm_inputs(model, mode="decode", context=context), target="trn2",
                 instance="trn2.48xlarge", mode="decode", tp=64, dtype=torch.bfloat16, compare=None)
    return r.step_time_s * 1e3


CASES = (
    Case("bf16 matmul [4096,8192]x[8192,8192]", "trn1, one NeuronCore, tuned NKI kernel", "ms", 6.97,
         "S25 NKI matmul tutorial (P99)", _matmul),
    Case("all-reduce 1 GiB, 64 ranks", "2x trn1.32xlarge, NeuronLink + EFA", "ms", 41.806,
         "S40 nccom-test guide (example output)", _allreduce_two_instances),
    Case("Llama-3.1-8B pre-training", "32x trn1.32xlarge, TP32 DP32, seq 8192, GBS 1024", "seq/s", 47.95,
         "S26 training_data_decoder.csv (SDK 2.24)", _llama8b_train),
    Case("BERT-Large phase-1 pre-training", "1x trn1.32xlarge, DP32, mb 16, seq 128", "seq/s", 3836.47,
         "S26 training_data_encoder.csv (SDK 2.27)", _bert_large_train),
    Case("Llama-3.3-70B decode, TPOT", "trn2.48xlarge, TP64 LNC2, BS1, 10k in", "ms", 19.6,
         "S27 llama70b_perf_comparison.csv", lambda: _decode("llama-70b", 10_750)),
    Case("Llama-3.1-405B decode, TPOT", "trn2.48xlarge, TP64 LNC2, BS1, 10k in", "ms", 37.9,
         "S28 llama405b_perf_comparison.csv", lambda: _decode("llama-405b", 10_900)),
)


@dataclass(frozen=True)
class Row:
    case: Case
    modelled: float

    @property
    def error(self) -> float:
        return self.modelled / self.case.published - 1


def run(cases: tuple[Case, ...] = CASES) -> list[Row]:
    return [Row(c, c.run()) for c in cases]


def table(rows: list[Row]) -> str:
    """The validation table in Markdown."""
    lines = ["| case | setup | published | modelled | error | source |", "|---|---|---|---|---|---|"]
    for r in rows:
        c = r.case
        lines.append(f"| {c.name} | {c.setup} | {c.published:,.2f} {c.metric} | "
                     f"{r.modelled:,.2f} {c.metric} | {r.error:+.1%} | {c.source} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()))
