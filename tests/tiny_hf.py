"""Tiny random Hugging Face configs, one per supported architecture, for parity tests.

Each builder covers the feature its architecture adds over plain Llama:

* ``llama_config``: llama3 rope scaling (``LLAMA3_ROPE``);
* ``qwen2_config``: tied input/output embeddings and q/k/v biases (Qwen2 always has them);
* ``qwen3_config``: q/k RMS norm (``head_dim`` explicit: Qwen3 does not derive it).

All share ``SHAPE``: D = 64, 2 layers, 4 query / 2 key-value heads (grouped queries), V = 256,
and ``initializer_range`` 0.3 instead of HF's 0.02 so random logits are peaked enough that
float32 rounding differences between torch and XLA cannot flip an argmax. Keyword overrides
replace any field (e.g. ``vocab_size=320`` or a different ``rope_scaling``). transformers is
imported when a config is built, so importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# llama3 scaling with an original context (32) shorter than max_position_embeddings, so the
# low-frequency bands are actually rescaled.
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def llama_config(**overrides: Any):
    """A tiny ``LlamaConfig`` with llama3 rope scaling."""
    import transformers

    return transformers.LlamaConfig(**{**SHAPE, "rope_scaling": LLAMA3_ROPE, **overrides})


def qwen2_config(**overrides: Any):
    """A tiny ``Qwen2Config``: tied embeddings, q/k/v biases."""
    import transformers

    return transformers.Qwen2Config(**{**SHAPE, "tie_word_embeddings": True, **overrides})


def qwen3_config(**overrides: Any):
    """A tiny ``Qwen3Config``: q/k norm, ``head_dim`` 16 (= D / heads unless overridden)."""
    import transformers

    return transformers.Qwen3Config(**{**SHAPE, "head_dim": 16, **overrides})


ARCHS = {"llama": llama_config, "qwen2": qwen2_config, "qwen3": qwen3_config}
