"""Named models for estimates, built from Hugging Face configs on the meta device (no weights, no downloads),
and their example inputs for each mode. `transformers` is imported only here."""
from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from ..hardware.config import default_env
from .estimate import EstimateError

# name -> (config class, config keyword arguments). Llama sizes are those of the published Llama 3.x models.
_LLAMA = dict(vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072,
              tie_word_embeddings=False)
PRESETS: dict[str, tuple[str, dict]] = {
    "gpt2-small": ("GPT2Config", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)),
    # Llama-3.2-1B (meta-llama/Llama-3.2-1B config; 1.24B parameters, tied embeddings): the usual draft model
    "llama-1b": ("LlamaConfig", dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, head_dim=64, tie_word_embeddings=True)),
    "llama-8b": ("LlamaConfig", dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32)),
    "llama-70b": ("LlamaConfig", dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64)),
    "llama-405b": ("LlamaConfig", dict(_LLAMA, hidden_size=16384, intermediate_size=53248,
                                       num_hidden_layers=126, num_attention_heads=128)),
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config): 8 experts, 2 per token, 46.7B parameters, 12.9B active
    "mixtral-8x7b": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                                           max_position_embeddings=32768, tie_word_embeddings=False)),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, the first 3 dense, then 256 routed experts (8
    # per token, sigmoid top-k in 8 groups) plus 1 shared; multi-head latent attention; 671B parameters, 37B active.
    # The multi-token-prediction module is not part of the model.
    "deepseek-v3": ("DeepseekV3Config", dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                             moe_intermediate_size=2048, num_hidden_layers=61,
                                             first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
                                             num_experts_per_tok=8, n_group=8, topk_group=4,
                                             num_attention_heads=128, num_key_value_heads=128,
                                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
                                             tie_word_embeddings=False)),
    # Qwen3 MoE (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json; the 2507 Instruct releases share the
    # widths): every layer MoE, 128 experts, 8 per token (renormalised), no shared expert, 4 KV heads of 128.
    # 30B-A3B: 48 layers, 2048 wide, experts 768 wide, 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, num_experts=128, num_experts_per_tok=8,
                                             norm_topk_prob=True, max_position_embeddings=262144,
                                             tie_word_embeddings=False)),
    # 235B-A22B: 94 layers, 4096 wide, experts 1536 wide, 235B parameters, 22B active
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=4096, moe_intermediate_size=1536,
                                               num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                               head_dim=128, num_experts=128, num_experts_per_tok=8,
                                               norm_topk_prob=True, max_position_embeddings=262144,
                                               tie_word_embeddings=False)),
}
_MODELS = {"GPT2Config": "GPT2LMHeadModel", "LlamaConfig": "LlamaForCausalLM",
           "MixtralConfig": "MixtralForCausalLM", "DeepseekV3Config": "DeepseekV3ForCausalLM",
           "Qwen3MoeConfig": "Qwen3MoeForCausalLM"}


def hf_model(config: Any) -> torch.nn.Module:
    """A causal-LM built from `config` on the meta device: parameters have shapes and dtypes, no storage."""
    default_env("HF_HUB_OFFLINE", "1")
    import transformers

    cls = getattr(transformers, _MODELS.get(type(config).__name__, "AutoModelForCausalLM"))
    with torch.device("meta"):
        return cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)


def config(name: str, **overrides: Any) -> Any:
    default_env("HF_HUB_OFFLINE", "1")
    import transformers

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    cls, kw = PRESETS[name]
    return getattr(transformers, cls)(**{**kw, **overrides})


def lm_inputs(model: torch.nn.Module, *, batch: int = 1, seq: int = 1024, mode: str = "train",
              context: int = 0, dtype: torch.dtype = torch.bfloat16,
              new_tokens: int = 1) -> dict | Callable[[], dict]:
    """Example inputs of a Hugging Face causal LM. train: input_ids and labels of [batch, seq]; forward:
    input_ids; decode: `new_tokens` new tokens per sequence (1; a speculative verification step checks
    several) after `context` cached tokens, in a static cache (a callable: the cache is built on the meta
    device by the estimator)."""
    if mode == "train":
        ids = torch.zeros(batch, seq, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}
    if mode == "forward":
        return {"input_ids": torch.zeros(batch, seq, dtype=torch.long)}
    cfg = model.config
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def build() -> dict:
        from transformers import StaticCache

        cache = StaticCache(config=cfg, max_cache_len=context + new_tokens)  # updated in place, as Neuron serving does
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        k = v = torch.empty(batch, heads, 1, dim, dtype=dtype)
        if getattr(cfg, "kv_lora_rank", None):  # multi-head latent attention caches one compressed head and
            k = torch.empty(batch, 1, 1, cfg.kv_lora_rank, dtype=dtype)  # the shared rotary key
            v = torch.empty(batch, 1, 1, cfg.qk_rope_head_dim, dtype=dtype)
        for layer in cache.layers:
            layer.lazy_initialization(k, v)
        inputs = {"input_ids": torch.zeros(batch, new_tokens, dtype=torch.long), key: cache, "use_cache": True,
                  "cache_position": torch.arange(context, context + new_tokens)}
        if new_tokens > 1:  # the mask over cache and new tokens, given whole: building it needs the positions' values
            inputs["attention_mask"] = torch.ones(batch, 1, new_tokens, context + new_tokens, dtype=torch.bool)
        return inputs

    return build


def check_spec(spec: str, flag: str = "--model") -> None:
    """ValueError naming `flag` unless `spec` is a preset or `path/to/file.py:function` with an existing file."""
    if spec in PRESETS:
        return
    path, _, fn = spec.rpartition(":")
    if not path or not fn:
        raise EstimateError(f"{flag} {spec!r}: use one of {', '.join(PRESETS)} or path/to/file.py:function")
    if not os.path.isfile(path):
        raise EstimateError(f"{flag} {spec!r}: no file {path!r}")


def load(spec: str, *, batch: int = 1, seq: int = 1024, mode: str = "train", context: int = 0,
         dtype: torch.dtype = torch.bfloat16, flag: str = "--model") -> tuple[torch.nn.Module, Any]:
    """A preset name, or `path/to/file.py:function` where function(batch=, seq=, mode=) returns
    (model, example_inputs). ValueError naming `flag` for a spec that is neither."""
    check_spec(spec, flag)
    if spec in PRESETS:
        model = hf_model(config(spec))
        return model, lm_inputs(model, batch=batch, seq=seq, mode=mode, context=context, dtype=dtype)
    path, _, fn = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("_torchneuron_estimate_model", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(build := getattr(module, fn, None)):
        raise EstimateError(f"{flag} {spec!r}: {path} defines no function {fn!r}")
    return build(batch=batch, seq=seq, mode=mode)
