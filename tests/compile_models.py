"""Small models for the compiler tests and benchmarks: an MLP, a CNN, and Hugging Face GPT-2 and encoder-decoder
models (T5, BART, Whisper) built from small configs (random weights, nothing downloaded, no dropout); the
nanoGPT-style model is torchneuron.models.TinyGPT."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def hf_gpt2(layers: int = 2, d: int = 64, heads: int = 4, vocab: int = 128, positions: int = 64) -> nn.Module:
    """A randomly initialised Hugging Face GPT-2 from a small config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=d, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def hf_t5(d: int = 32, layers: int = 2, heads: int = 4, vocab: int = 64) -> nn.Module:
    """A small T5 (relative position bias: the attention mask is a learnt bias, so SDPA's backward returns its
    gradient)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=vocab, d_model=d, d_kv=d // heads, d_ff=2 * d, num_layers=layers,
                   num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def hf_bart(d: int = 32, layers: int = 2, heads: int = 4, vocab: int = 64, positions: int = 32) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers,
                     encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * d,
                     decoder_ffn_dim=2 * d, max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg)


def hf_whisper(d: int = 32, layers: int = 2, heads: int = 4, vocab: int = 64, mels: int = 8,
               frames: int = 16) -> nn.Module:
    """A small Whisper: a convolutional audio encoder over (batch, mels, frames) features and a text decoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=mels, d_model=d, encoder_layers=layers,
                        decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                        encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d, max_source_positions=frames // 2,
                        max_target_positions=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=3, begin_suppress_tokens=None, suppress_tokens=None)
    return WhisperForConditionalGeneration(cfg)
