"""End to end: a small GPT and a CNN train on `neuron` with losses equal to the CPU's (same initial weights, no
dropout: the neuron generator is counter-based like CUDA's and draws other numbers than the CPU's mt19937)."""
import copy

import pytest
import torch

import torchneuron
from torchneuron.models import GPTConfig, SmallCNN, TinyGPT, gpt_batch, image_batch, train_steps


def _compare(make_model, make_batches, steps=20):
    torch.manual_seed(0)
    model = make_model()
    cpu = train_steps(copy.deepcopy(model), make_batches(), "cpu", steps)
    torchneuron.clear_op_tracking()
    dev = train_steps(copy.deepcopy(model), make_batches(), "neuron", steps)
    return cpu, dev


@pytest.mark.parametrize("sdpa", [False, True], ids=["explicit-attention", "sdpa"])
def test_small_gpt_trains_like_cpu(sdpa):
    cfg = GPTConfig(dropout=0.0, sdpa=sdpa)
    cpu, dev = _compare(lambda: TinyGPT(cfg), lambda: (gpt_batch(cfg, 8, torch.Generator().manual_seed(i))
                                                       for i in range(20)))
    assert len(dev) == 20 and dev[-1] < dev[0]
    torch.testing.assert_close(dev, cpu, rtol=1e-5, atol=1e-5)
    assert torchneuron.get_fallback_ops() == {}  # the whole step runs on native ops


@pytest.mark.parametrize("sdpa", [False, True], ids=["explicit-attention", "sdpa"])
def test_small_gpt_with_dropout_is_reproducible(sdpa):
    """With dropout the masks come from the neuron generator: the same seed gives the same run, bit for bit (SDPA:
    its attention dropout too, drawn at the launch of the queued kernel)."""
    cfg = GPTConfig(sdpa=sdpa)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    runs = [train_steps(copy.deepcopy(model), (gpt_batch(cfg, 8, torch.Generator().manual_seed(i)) for i in range(8)),
                        "neuron", 8) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][-1] < runs[0][0]
    assert torchneuron.get_fallback_ops() == {}


def _cnn_without_dropout() -> SmallCNN:
    model = SmallCNN()
    model.head[1].p = 0.0  # its nn.Dropout: the neuron generator draws other masks than the CPU's
    return model


def test_cnn_trains_like_cpu():
    cpu, dev = _compare(_cnn_without_dropout,
                        lambda: (image_batch(16, torch.Generator().manual_seed(i)) for i in range(20)))
    assert dev[-1] < dev[0]
    torch.testing.assert_close(dev, cpu, rtol=1e-5, atol=1e-5)
    assert torchneuron.get_fallback_ops() == {}
