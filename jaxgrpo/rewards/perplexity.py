"""The seed study's delta-NLL ("perplexity improvement") reward, computed in JAX.

For a prompt p, a generated reasoning r_gen and the reference reasoning r_ref, with the frozen
base model (LoRA zeroed):

    NLL(p, r) = -(1 / |r|) * sum_{t in r} log p_theta(y_t | y_<t),   y = p || "<reasoning>" || r
    delta     = NLL(p, r_ref) - NLL(p, r_gen)
    reward    = tanh(delta)                                           in (-1, 1)

Sign convention (the seed study's "On perplexity based reward calculation"): the reward is
positive when the base model finds the generated reasoning MORE likely (lower NLL) than the
reference, negative when less likely; tanh bounds it softly.

Details we fixed where the seed study is silent:

- The average runs over the tokens of r only (the appended part after ``"<reasoning>"``); the
  prompt and separator are identical on both sides, so including them would only dilute delta.
- p, ``"<reasoning>"`` and r are tokenized separately (no special tokens added: prompts arrive
  already rendered by the chat template) and concatenated, so the scored span is exact.
- Each sequence is truncated to ``max_length`` (2048) tokens by cutting its end, like a
  tokenizer with ``truncation=True``; the average covers the surviving tokens of r.
- r_gen is the completion's reasoning (``embedding.reasoning_text``: answer spans and tag markup
  removed) when ``strip_answer`` (default), else the whole completion.
- Missing reference, or a reference with no surviving tokens: ``None`` (cannot score). A
  generated reasoning with no surviving tokens scores -1, the minimum, so an empty completion is
  never a safe choice.

The batch runs through one jitted function over the split model state; rows are padded to
power-of-two buckets (rows and length), and the log-probs come from
``jaxgrpo.rl.logprobs.head_token_logprobs`` in chunks along T, so a full ``[B, T, V]``
float32 array never exists.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.rewards.embedding import reasoning_text
from jaxgrpo.rl.logprobs import head_token_logprobs
from jaxgrpo.types import Array

SEPARATOR = "<reasoning>"


def _text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``text -> ids`` without special tokens, for jaxgrpo, transformers or tokenizers objects."""
    hf = getattr(tokenizer, "hf", tokenizer)  # jaxgrpo Tokenizer wraps a transformers one.
    if hasattr(hf, "encode_batch"):  # A raw `tokenizers.Tokenizer`.
        return lambda text: list(hf.encode(text, add_special_tokens=False).ids)
    return lambda text: list(hf.encode(text, add_special_tokens=False))


def sequence_nll_fn(model: nnx.Module, chunk: int = 128) -> Callable:
    """A jitted ``(state, ids_BT, mask_BT, weight_BT) -> (nll_sum_B, count_B)``.

    ``weight_BT[b, t] = 1`` marks that the token at ``t + 1`` is scored, i.e. its log-prob comes
    from the logits at position ``t``. The graphdef is closed over; the weights are an argument.
    """
    graphdef, _ = nnx.split(model)

    def nll(state, ids_BT: Array, mask_BT: Array, weight_BT: Array) -> tuple[Array, Array]:
        m = nnx.merge(graphdef, state)
        b, t = ids_BT.shape
        h_BTD = m.forward(ids_BT, mask_BT)
        targets_BT = jnp.concatenate([ids_BT[:, 1:], jnp.zeros((b, 1), ids_BT.dtype)], axis=1)
        ones_BT = jnp.ones((b, t), jnp.float32)  # temperature 1: the model's own distribution
        logp_BT, _ = head_token_logprobs(m, h_BTD, targets_BT, ones_BT, chunk)
        w_BT = weight_BT.astype(jnp.float32)
        return -(logp_BT * w_BT).sum(axis=1), w_BT.sum(axis=1)

    return jax.jit(nll)


class PerplexityReward:
    """Delta-NLL reward bound to one frozen model and tokenizer (see the module docstring).

    The model's weights are snapshotted at construction (``nnx.split``), so later in-place
    updates of the policy's LoRA do not leak into the reference scores.

    Args:
      model: a ``jaxgrpo.models.transformer.Transformer`` (contract 2), LoRA zeroed.
      tokenizer: jaxgrpo ``Tokenizer``, a transformers tokenizer or a ``tokenizers.Tokenizer``.
      max_length: truncation length of each sequence, in tokens.
      batch_size: sequences per jitted call (each sample needs two).
      strip_answer: score the reasoning only (answer spans removed) instead of the whole text.
      chunk: length chunk of the logits computation.
      min_bucket: shortest padded length (larger: fewer distinct shapes, so fewer compilations).
    """

    def __init__(
        self,
        model: nnx.Module,
        tokenizer,
        *,
        max_length: int = 2048,
        batch_size: int = 8,
        strip_answer: bool = True,
        chunk: int = 128,
        min_bucket: int = 16,
    ):
        self.encode = _text_encoder(tokenizer)
        self.max_length = max_length
        self.batch_size = batch_size
        self.strip_answer = strip_answer
        self.chunk = chunk
        self.min_bucket = min_bucket
        self.pad_id = int(getattr(tokenizer, "pad_id", 0) or 0)
        _, self.state = nnx.split(model)
        self._nll = sequence_nll_fn(model, chunk)
        self.__name__ = "perplexity"

    def _row(self, prompt: str, text: str) -> tuple[list[int], int]:
        """Token ids of ``prompt || SEPARATOR || text`` (truncated) and where ``text`` starts."""
        head = self.encode(prompt) + self.encode(SEPARATOR)
        ids = (head + self.encode(text))[: self.max_length]
        return ids, len(head)

    def nll(self, prompts: list[str], texts: list[str]) -> np.ndarray:
        """Token-averaged NLL of each text after its prompt; NaN where no text token survives."""
        rows = [self._row(p, t) for p, t in zip(prompts, texts, strict=True)]
        out = np.full(len(rows), np.nan, np.float64)
        for start in range(0, len(rows), self.batch_size):
            part = rows[start : start + self.batch_size]
            n = bucket_length(len(part), 1, self.batch_size)
            t = bucket_length(max(len(ids) for ids, _ in part), self.min_bucket, self.max_length)
            t = -(-t // min(self.chunk, t)) * min(self.chunk, t)  # A multiple of the chunk.
            ids = np.full((n, t), self.pad_id, np.int32)
            mask = np.zeros((n, t), np.int32)
            weight = np.zeros((n, t), np.int32)
            mask[:, 0] = 1  # Padding rows keep one valid token so attention stays finite.
            for i, (row, start_r) in enumerate(part):
                ids[i, : len(row)] = row
                mask[i, : len(row)] = 1
                # Logits at position j predict token j + 1: score tokens start_r .. len-1.
                weight[i, max(start_r - 1, 0) : len(row) - 1] = 1
            total, count = (np.asarray(x) for x in self._nll(self.state, ids, mask, weight))
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
            out[start : start + len(part)] = mean[: len(part)]
        return out

    def __call__(
        self, prompts: list[str], completions: list[str], *, reference: list, **_
    ) -> list[float | None]:
        """``tanh(NLL(p, r_ref) - NLL(p, r_gen))`` per sample (None: no usable reference)."""
        if not (len(prompts) == len(completions) == len(reference)):
            raise ValueError(
                f"perplexity: {len(prompts)} prompts, {len(completions)} completions, "
                f"{len(reference)} references"
            )
        gen = [reasoning_text(c) if self.strip_answer else c for c in completions]
        keep = [i for i, r in enumerate(reference) if r is not None and str(r).strip()]
        # The G samples of a group share (prompt, reference): score each distinct pair once.
        pairs = [(prompts[i], str(reference[i])) for i in keep] + [
            (prompts[i], gen[i]) for i in keep
        ]
        unique = list(dict.fromkeys(pairs))
        nll_u = self.nll([p for p, _ in unique], [t for _, t in unique])
        nll = dict(zip(unique, nll_u, strict=True))
        out: list[float | None] = [None] * len(completions)
        for j, i in enumerate(keep):
            ref_nll, gen_nll = nll[pairs[j]], nll[pairs[len(keep) + j]]
            if np.isnan(ref_nll):
                continue
            out[i] = -1.0 if np.isnan(gen_nll) else float(np.tanh(ref_nll - gen_nll))
        return out


def make_perplexity_reward(model: nnx.Module, tokenizer, **kwargs) -> PerplexityReward:
    """The reward function for ``model`` (frozen base, LoRA zeroed) and ``tokenizer``.

    Keyword arguments are ``PerplexityReward``'s (``max_length``, ``batch_size``, ...).
    """
    return PerplexityReward(model, tokenizer, **kwargs)


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def perplexity(
    prompts: list[str],
    completions: list[str],
    *,
    reference: list,
    model: nnx.Module | None = None,
    tokenizer=None,
    max_length: int = 2048,
    **columns,
) -> list[float | None]:
    """Registry form: ``get_reward("perplexity", model=base, tokenizer=tok)``.

    The bound reward (and its compiled function) is cached per model object, so binding the
    model with ``functools.partial`` costs one compilation per shape bucket, not one per call.
    """
    if model is None or tokenizer is None:
        raise ValueError(
            "the perplexity reward needs the frozen base model: "
            "get_reward('perplexity', model=base_model, tokenizer=tokenizer) or "
            "jaxgrpo.rewards.perplexity.make_perplexity_reward(model, tokenizer)"
        )
    key = (id(tokenizer), max_length)
    per_model = _CACHE.setdefault(model, {})
    if key not in per_model:
        per_model[key] = PerplexityReward(model, tokenizer, max_length=max_length)
    return per_model[key](prompts, completions, reference=reference, **columns)
