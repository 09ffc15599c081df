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

The texts that follow one prompt (a group's G completions and its reference) share one pass
over ``p || "<reasoning>"`` and are packed end to end in one row that attends it
(``jaxgrpo.models.logprobs.packed_logprobs``, the learner's scoring): the prompt, usually most of
the tokens, runs once per group instead of once per text. Shapes are padded to buckets (groups,
texts per group, prompt and text lengths), and the log-probs come in chunks along T, so a full
``[B, T, V]`` float32 array never exists.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.models.logprobs import packed_logprobs
from jaxgrpo.models.packing import Packing, pack
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.rewards.embedding import reasoning_text

SEPARATOR = "<reasoning>"


def _text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``text -> ids`` without special tokens, for jaxgrpo, transformers or tokenizers objects."""
    hf = getattr(tokenizer, "hf", tokenizer)  # jaxgrpo Tokenizer wraps a transformers one.
    if hasattr(hf, "encode_batch"):  # A raw `tokenizers.Tokenizer`.
        return lambda text: list(hf.encode(text, add_special_tokens=False).ids)
    return lambda text: list(hf.encode(text, add_special_tokens=False))


def packed_nll_fn(model: nnx.Module, chunk: int = 128) -> Callable:
    """A jitted ``(state, prompt_ids_BP, prompt_mask_BP, ids_RT, mask_RT, packing) ->
    (nll_sum_R, count_R)``: each row's text scored after its group's prompt (temperature 1),
    the G = R / B texts of a group packed into one row. The graphdef is closed over."""
    graphdef, _ = nnx.split(model)

    def nll(state, prompt_ids_BP, prompt_mask_BP, ids_RT, mask_RT, packing: Packing):
        m = nnx.merge(graphdef, state)
        ones_RT = jnp.ones(ids_RT.shape, jnp.float32)  # the model's own distribution
        logp_RT, _ = packed_logprobs(
            m, prompt_ids_BP, prompt_mask_BP, ids_RT, ones_RT, packing, chunk
        )
        w_RT = mask_RT.astype(jnp.float32)
        return -(logp_RT * w_RT).sum(axis=1), w_RT.sum(axis=1)

    return jax.jit(nll)


class PerplexityReward:
    """Delta-NLL reward bound to one frozen model and tokenizer (see the module docstring).

    The model's weights are snapshotted at construction (``nnx.split``), so later in-place
    updates of the policy's LoRA do not leak into the reference scores.

    Args:
      model: a ``jaxgrpo.models.transformer.Transformer`` (contract 2), LoRA zeroed.
      tokenizer: jaxgrpo ``Tokenizer``, a transformers tokenizer or a ``tokenizers.Tokenizer``.
      max_length: truncation length of each sequence, in tokens.
      batch_size: prompts (each with all its texts) per jitted call.
      strip_answer: score the reasoning only (answer spans removed) instead of the whole text.
      chunk: length chunk of the logits computation.
      min_bucket: shortest padded text length (larger: fewer distinct shapes, so fewer
        compilations).
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
        self._nll = packed_nll_fn(model, chunk)
        self.__name__ = "perplexity"

    def nll(self, prompts: list[str], texts: list[str]) -> np.ndarray:
        """Token-averaged NLL of each text after its prompt; NaN where no text token survives.

        Texts after the same prompt are scored in one group: one pass over ``prompt ||
        SEPARATOR``, the texts packed after it.
        """
        groups: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(prompt, []).append(i)
        items = list(groups.items())
        out = np.full(len(prompts), np.nan, np.float64)
        for start in range(0, len(items), self.batch_size):
            part = items[start : start + self.batch_size]
            heads = [(self.encode(p) + self.encode(SEPARATOR))[: self.max_length] for p, _ in part]
            # Each sequence is cut to max_length tokens: the text keeps what fits after its head.
            bodies = [
                [self.encode(texts[i])[: self.max_length - len(head)] for i in rows]
                for (_, rows), head in zip(part, heads, strict=True)
            ]
            total, count = self._score(heads, bodies)
            for (_, rows), tot, cnt in zip(part, total, count, strict=False):
                for row, t_sum, c in zip(rows, tot, cnt, strict=False):
                    out[row] = t_sum / c if c > 0 else np.nan
        return out

    def _score(self, heads: list[list[int]], bodies: list[list[list[int]]]) -> tuple:
        """(NLL sums, token counts) per group and text: [B, G] each, padded rows last."""
        b = bucket_length(len(heads), 1, self.batch_size)
        g = bucket_length(max(len(x) for x in bodies), 1)
        p = -(-max(len(h) for h in heads) // 64) * 64  # prompt columns: a multiple of 64
        longest = max((len(x) for group in bodies for x in group), default=1)
        t = bucket_length(max(longest, 1), self.min_bucket, max(self.max_length, 1))
        prompt_ids, prompt_mask = np.full((b, p), self.pad_id, np.int32), np.zeros((b, p), np.int32)
        prompt_mask[:, -1] = 1  # padding groups keep one valid slot, so attention stays finite
        ids, mask = np.full((b * g, t), self.pad_id, np.int32), np.zeros((b * g, t), np.int32)
        for i, (head, group) in enumerate(zip(heads, bodies, strict=True)):
            prompt_ids[i, p - len(head) :], prompt_mask[i, p - len(head) :] = head, 1
            for j, body in enumerate(group):
                ids[i * g + j, : len(body)], mask[i * g + j, : len(body)] = body, 1
        packing = pack(mask.sum(axis=1), g, t)
        total, count = self._nll(self.state, prompt_ids, prompt_mask, ids, mask, packing)
        return np.asarray(total).reshape(b, g), np.asarray(count).reshape(b, g)

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
