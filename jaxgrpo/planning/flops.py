"""Analytic FLOPs and weight bytes of the programs of a GRPO step (whole slice, one call).

XLA's ``cost_analysis`` counts a while-loop or scan body once, so a layer scan or the decode
loop is undercounted by its trip count; these counts are the model's arithmetic instead. A
matmul of an [m, k] by a [k, n] matrix is ``2 m k n`` FLOPs; attention adds ``4 * N * H`` per
(query, key) pair (scores and the weighted sum); norms, RoPE and softmax are left out.
"""

from __future__ import annotations

from jaxgrpo.models.config import ModelConfig
from jaxgrpo.planning import memory

_BYTES = {"float32": 4, "bfloat16": 2}


def matmul_params(cfg: ModelConfig) -> int:
    """Weights multiplied once per token by the layers (no embedding, no LM head)."""
    d = cfg.hidden_size
    head = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return memory.base_param_count(cfg) - head - d


def _attention(cfg: ModelConfig, tokens: float, context: float) -> float:
    """The attention core (scores and weighted sum) of ``tokens`` queries over ``context`` keys
    on average, every layer."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * context


def _forward(cfg: ModelConfig, tokens: float, context: float, logits: float) -> float:
    """A forward pass over ``tokens`` tokens attending ``context`` keys on average, with the
    LM head applied at ``logits`` positions."""
    head = 2.0 * cfg.vocab_size * cfg.hidden_size * logits
    return 2.0 * matmul_params(cfg) * tokens + _attention(cfg, tokens, context) + head


def prefill(cfg: ModelConfig, prompts: int, prompt_len: int) -> float:
    """The prompts once (causal: half the prompt on average), logits at the last position."""
    return _forward(cfg, prompts * prompt_len, prompt_len / 2, prompts)


def decode(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int) -> float:
    """``new_tokens`` one-token steps of ``rows`` rows over a growing cache (upper bound:
    every row runs to the end)."""
    return _forward(cfg, rows * new_tokens, prompt_len + new_tokens / 2, rows * new_tokens)


def _score_parts(prompts: int, prompt_len: int, rows: int, new_tokens: int) -> tuple:
    """(tokens, keys attended on average, logit positions) of the scoring pass's two parts:
    each prompt once, then each completion after its prompt."""
    return (
        (prompts * prompt_len, prompt_len / 2, 0),
        (rows * new_tokens, prompt_len + new_tokens / 2, rows * new_tokens),
    )


def score(cfg: ModelConfig, prompts: int, prompt_len: int, rows: int, new_tokens: int) -> float:
    """The prefix-shared scoring pass: each prompt once, each completion after its prompt."""
    return sum(_forward(cfg, *part) for part in _score_parts(prompts, prompt_len, rows, new_tokens))


def update(cfg: ModelConfig, prompts: int, prompt_len: int, rows: int, new_tokens: int) -> float:
    """One minibatch's forward and backward: the backward pass costs twice the forward with
    full fine-tuning (activation and weight gradients), once with LoRA (activation gradients
    only; the adapters' own matmuls are negligible), plus what remat recomputes: one more
    forward, or with ``remat_policy="projections"`` only the attention core."""
    forward = score(cfg, prompts, prompt_len, rows, new_tokens)
    backward = 1.0 if cfg.lora is not None else 2.0
    recompute = 0.0
    if cfg.remat and cfg.remat_policy == "projections":
        parts = _score_parts(prompts, prompt_len, rows, new_tokens)
        recompute = sum(_attention(cfg, tokens, keys) for tokens, keys, _ in parts)
    elif cfg.remat:
        recompute = forward
    return forward * (1.0 + backward) + recompute


def weight_bytes(cfg: ModelConfig) -> float:
    """Bytes of every weight in the compute dtype (what one pass reads, whole slice)."""
    params = memory.base_param_count(cfg) + memory.lora_param_count(cfg)
    return float(params * _BYTES[cfg.dtype])
