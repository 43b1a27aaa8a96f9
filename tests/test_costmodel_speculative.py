"""Speculative decoding (costmodel/speculative.py) against values computed here: the expected tokens per round
of Leviathan et al. (2023) and the verification step's work, k + 1 tokens through every weight once."""
from __future__ import annotations

import pytest
import torch

from torchneuron.costmodel import presets
from torchneuron.costmodel.speculative import Speculative, speculative

BF16 = torch.bfloat16


def _llama(layers: int):
    return presets.hf_model(presets.config("llama-8b", num_hidden_layers=layers))


@pytest.fixture(scope="module")
def run():
    return speculative(_llama(2), _llama(1), context=512, k=4, acceptance=0.8, target="trn2", tp=8, dtype=BF16)


def test_a_round_yields_the_expected_accepted_prefix_plus_one(run):
    """Each of k = 4 drafted tokens is accepted with probability 0.8 until the first rejection; the target adds
    one token: 1 + 0.8 + 0.8^2 + 0.8^3 + 0.8^4 tokens per round."""
    tokens = 1 + 0.8 + 0.8**2 + 0.8**3 + 0.8**4
    assert run.tokens_per_round == pytest.approx(tokens)
    assert run.tpot_s == pytest.approx((4 * run.draft.step_time_s + run.verify.step_time_s) / tokens)
    assert Speculative(run.draft, run.verify, 4, 1.0).tokens_per_round == 5
    assert Speculative(run.draft, run.verify, 4, 0.0).tokens_per_round == 1


def test_verification_runs_k_plus_one_tokens_through_each_weight_once(run):
    """Llama-3.1-8B widths, 2 layers: per token 2 x (q, o: 4096 x 4096; k, v: 1024 x 4096; gate, up, down:
    3 x 4096 x 14336) + the head 4096 x 128256 multiply-adds; the verification step does it for k + 1 = 5
    tokens (over 8 cores), the draft (1 layer) for one. The verification reads the weights once: it costs
    far less than 5 single-token steps."""
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336
    head = 4096 * 128256
    linear = lambda r: sum(o.flops for o in r.ops if o.op in ("mm", "addmm", "linear", "bmm"))
    assert linear(run.verify) == pytest.approx(2 * 5 * (2 * layer + head) / 8, rel=1e-3)
    assert linear(run.draft) == pytest.approx(2 * (layer + head) / 8, rel=1e-3)
    one = speculative(_llama(2), _llama(1), context=512, k=1, acceptance=0.8, target="trn2", tp=8, dtype=BF16)
    assert run.verify.step_time_s < 2 * one.verify.step_time_s


def test_acceptance_must_be_a_probability():
    with pytest.raises(ValueError, match=r"acceptance must be in \[0, 1\]"):
        speculative(_llama(1), _llama(1), context=8, k=2, acceptance=1.5)


def test_cli_prints_the_speculative_tpot(capsys):
    """`estimate --mode decode --speculate 3 --draft llama-1b --acceptance 0.5`: 1 + 0.5 + 0.25 + 0.125 = 1.875
    tokens per round."""
    import argparse

    from torchneuron.costmodel import cli

    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    with pytest.raises(ValueError, match="needs --mode decode, --speculate K, --draft MODEL and --acceptance A"):
        cli.check_estimate_arguments(p.parse_args(["--mode", "decode", "--speculate", "3"]), cli.usage_error)
    with pytest.raises(ValueError, match=r"--acceptance must be in \[0, 1\]"):
        cli.check_estimate_arguments(p.parse_args(["--mode", "decode", "--speculate", "3", "--draft", "llama-1b",
                                                   "--acceptance", "2"]), cli.usage_error)
    args = ["--model", "llama-8b", "--mode", "decode", "--seq", "64", "--tp", "8", "--speculate", "3", "--draft",
            "llama-1b", "--acceptance", "0.5", "--compare", "none", "--top", "0"]
    assert cli.run_estimate(p.parse_args(args)) == 0
    out = capsys.readouterr().out
    assert "8 x trn2: speculative decoding, k=3, acceptance 0.50: 1.88 tokens per round" in out


def test_llama_1b_preset_is_the_published_draft_size():
    """Llama-3.2-1B: 1.24B parameters (16 layers of 2048, tied 128,256-token embeddings)."""
    m = presets.hf_model(presets.config("llama-1b"))
    layer = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    assert sum(p.numel() for p in m.parameters()) == 16 * layer + 128256 * 2048 + 2048
