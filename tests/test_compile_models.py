"""Whole models under `torch.compile(backend="neuron")`: forward outputs, losses, gradients and the parameters
after SGD steps match eager `neuron` (same seeds, so dropout draws the same masks) and eager CPU (models without
dropout: the neuron generator is counter-based like CUDA's and draws other masks than the CPU's mt19937). The zoo
covers decoder-only (GPT), vision (CNN) and encoder-decoder models (T5, BART, Whisper: cross-attention, learnt
attention biases and a convolutional audio encoder through the backward)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from compile_models import CNN, MLP, hf_bart, hf_gpt2, hf_t5, hf_whisper

from torchneuron.models import GPTConfig, TinyGPT

STEPS = 2
TOL = {"rtol": 1e-4, "atol": 1e-5}


def classify(model, x, y):
    logits = model(x)
    return logits, F.cross_entropy(logits, y)


def language(model, x, y):
    return model(x, y)


def hf_language(model, x, y):
    out = model(input_ids=x, labels=y)
    return out.logits, out.loss


def hf_speech(model, x, y):
    out = model(input_features=x, labels=y)
    return out.logits, out.loss


def train(model, batch, step_fn, device: str, compiled: bool) -> dict:
    """STEPS SGD steps from the same seed; returns what each step produced and the final parameters."""
    torch.manual_seed(0)
    m = copy.deepcopy(model).to(device).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    fn = torch.compile(m, backend="neuron") if compiled else m
    x, y = (t.to(device) for t in batch)
    out = {"logits": [], "loss": [], "grads": []}
    for _ in range(STEPS):
        logits, loss = step_fn(fn, x, y)
        loss.backward()
        out["logits"].append(logits.detach().cpu())
        out["loss"].append(loss.detach().cpu())
        out["grads"].append([p.grad.detach().cpu() for p in m.parameters() if p.requires_grad])
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = [p.detach().cpu() for p in m.parameters()]
    return out


GPT = GPTConfig(vocab_size=128, block_size=32, dropout=0.1)
CASES = {
    "mlp": (MLP, lambda: (torch.randn(16, 32), torch.randint(0, 10, (16,))), classify),
    "cnn": (CNN, lambda: (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))), classify),
    "gpt": (lambda: TinyGPT(GPT), lambda: (torch.randint(0, 128, (4, 32)),) * 2, language),
    "hf_gpt2": (hf_gpt2, lambda: (torch.randint(0, 128, (2, 16)),) * 2, hf_language),
    # encoder-decoder models: the decoder's cross-attention, the encoder's and decoder's backward
    "hf_t5": (hf_t5, lambda: (torch.randint(3, 64, (2, 8)), torch.randint(3, 64, (2, 8))), hf_language),
    "hf_bart": (hf_bart, lambda: (torch.randint(3, 64, (2, 8)), torch.randint(3, 64, (2, 8))), hf_language),
    "hf_whisper": (hf_whisper, lambda: (torch.randn(2, 8, 16), torch.randint(3, 64, (2, 8))), hf_speech),
}


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory):
    if request.param.startswith("hf_"):
        pytest.importorskip("transformers")
    make_model, make_batch, step_fn = CASES[request.param]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "neuron-cache"))
        torch._dynamo.reset()
        torch.neuron.reset_dynamo_metrics()
        torch.manual_seed(0)
        model, batch = make_model(), make_batch()
        compiled = train(model, batch, step_fn, "neuron", compiled=True)
        metrics = torch.neuron.get_dynamo_metrics()
        torch._dynamo.reset()
    return {"compiled": compiled, "metrics": metrics, "eager": train(model, batch, step_fn, "neuron", False),
            "cpu": None if request.param == "gpt" else train(model, batch, step_fn, "cpu", False)}  # GPT: dropout


def test_matches_eager_neuron(runs):
    torch.testing.assert_close(runs["compiled"], runs["eager"], **TOL)


def test_matches_cpu(runs):
    if runs["cpu"] is None:
        pytest.skip("dropout masks: neuron draws Philox numbers, the CPU mt19937 ones (docs/device.md, RNG)")
    torch.testing.assert_close(runs["compiled"], runs["cpu"], **TOL)


def test_compiled_once_without_fallback(runs):
    m = runs["metrics"]
    assert m and all(r["fallback"] is None and r["kernels"] >= 1 for r in m)
    assert all(r["recompiles"] == 0 for r in m)  # the second step reused every executable
