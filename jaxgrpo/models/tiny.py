"""The "tiny" model source: a random 2-layer Llama and a small BPE tokenizer, built offline.

Tests, the notebook and `configs/tiny.py` need a whole training step to run in seconds on a CPU
with no download. A random decoder is easy; a tokenizer with a chat template is the part that
normally comes from the hub. This module trains a byte-level BPE tokenizer in milliseconds on a
fixed corpus (the prompts of the shipped tasks), with ChatML special tokens and template, so
chat prompts are a few dozen tokens and the vocabulary fits a tiny embedding (V = 384).
Everything is deterministic: the same seed gives the same weights and the same tokenizer.
"""

from __future__ import annotations

import functools
from typing import Any

from flax import nnx

from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.construct import random_model
from jaxgrpo.models.layout import Layout
from jaxgrpo.models.tokenizer import Tokenizer
from jaxgrpo.models.transformer import Transformer

TINY_VOCAB = 384
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "You are a strict formatter. Reply with exactly one <answer></answer> tag that contains "
    "the requested value, and write nothing outside the tag.",
    "Copy this integer exactly: 4096",
    "<answer>4096</answer> <answer>12345</answer> <answer>678</answer>",
    "Solve this question by reasoning step by step and enclose the final answer in "
    "<answer></answer>",
    "<think> reasoning </think> The answer is 42. system user assistant",
    "0123456789 10 20 30 40 50 60 70 80 90 100 1000",
)


def tiny_model_config(lora: LoRAConfig | None = None, dtype: str = "float32") -> ModelConfig:
    """The tiny Llama: D=64, 2 layers, 4/2 heads, F=128, V=384."""
    return ModelConfig(
        arch="llama",
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        dtype=dtype,
        param_dtype=dtype,
        lora=lora,
    )


@functools.cache
def _hf_tokenizer():
    # Local: transformers takes seconds to import, and only the tiny source trains a tokenizer.
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(list(_CORPUS) * 8, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def tiny_tokenizer():
    """A `jaxgrpo.models.tokenizer.Tokenizer` over the tiny BPE vocabulary (<= TINY_VOCAB ids)."""
    return Tokenizer(_hf_tokenizer())


def tiny_model(
    lora: LoRAConfig | None = None,
    *,
    seed: int = 0,
    dtype: str = "float32",
    param_dtype: str | None = None,
    mesh: Any = None,
    rules: Any = None,
    layout: Layout = Layout(),
    remat: bool = False,
    remat_policy: str = "full",
):
    """Builds the random tiny model and its tokenizer.

    Args:
        lora: adapters to declare, or None for full fine-tuning.
        seed: parameter seed.
        dtype: "float32" or "bfloat16": compute dtype, and storage unless `param_dtype`.
        param_dtype: storage dtype of the weights when it differs from `dtype`.
        mesh: optional mesh; parameters are then created sharded by `rules`.
        rules: logical-axis rules (default `jaxgrpo.core.sharding.TRAIN_RULES`).
        layout: how the work is laid out (`jaxgrpo.models.layout`); default the portable
            layout.
        remat / remat_policy: as `ModelConfig`'s.

    Returns:
        (model, tokenizer).
    """
    cfg = tiny_model_config(lora, dtype).replace(
        param_dtype=param_dtype or dtype, layout=layout, remat=remat, remat_policy=remat_policy
    )
    if mesh is not None:
        model = random_model(cfg, seed, mesh=mesh, rules=rules)
    else:
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
    return model, tiny_tokenizer()
