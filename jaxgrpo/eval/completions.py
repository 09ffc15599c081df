"""Completions of many prompts in fixed-shape batches over the mesh: the one generation loop of
evaluation, for a model (``sample``) and for the learner's split state (``held_out``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from jaxgrpo.core import sharding
from jaxgrpo.sampling import SamplerSettings, StopReason, generate_from_state

if TYPE_CHECKING:  # the config's type only: settings lie above the evaluation loop
    from jaxgrpo.settings.schema import EvalConfig


@dataclasses.dataclass(frozen=True)
class Settings:
    """How an evaluation samples and judges: the config's ``eval`` section (its defaults, the
    seed study's, are in ``configs/base.py``) plus the split, example cap and seed."""

    split: str
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    max_examples: int | None
    batch_size: int
    seed: int
    judge_source: str
    judge_prompt: str

    @classmethod
    def from_config(
        cls,
        eval_cfg: EvalConfig,
        *,
        split: str = "test",
        max_examples: int | None = None,
        seed: int = 0,
        **changes: Any,
    ) -> Settings:
        """The settings of ``eval_cfg`` (``every`` is the trainer's), ``changes`` replacing
        fields of it (e.g. ``num_samples=2``)."""
        fields = {k: v for k, v in dataclasses.asdict(eval_cfg).items() if k != "every"}
        return cls(split=split, max_examples=max_examples, seed=seed, **(fields | changes))

    def sampler(self, tokenizer: Any, *, greedy: bool = False) -> SamplerSettings:
        """The sampler's settings: these knobs, or (``greedy``) one 4-token greedy reply per
        prompt (the judge's)."""
        if greedy:
            return SamplerSettings.for_tokenizer(tokenizer, max_new_tokens=4, temperature=0.0)
        return SamplerSettings.for_tokenizer(
            tokenizer,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            num_samples=self.num_samples,
        )


def complete(
    graphdef: Any,
    states: Sequence[Any],
    model_cfg: Any,
    tokenizer: Any,
    messages: list,
    mesh: Any,
    settings: SamplerSettings,
    *,
    batch_size: int,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list]:
    """Completions of every prompt, ``settings.num_samples`` each, ``batch_size`` prompts per
    call.

    A fixed batch shape (the last batch padded with its final prompt) compiles once; the
    padding's completions are dropped. Prompt rows are sharded as in training.

    Args:
      graphdef / states / model_cfg: the split model, as for ``generate_from_state``.
      tokenizer: its ``encode_chat`` gives the left-padded prompts.
      messages: [B] chats.
      mesh: the device mesh.
      settings: how to sample (G = ``settings.num_samples`` completions per prompt).
      batch_size: prompts per call.
      seed: batch i samples with ``fold_in(key(seed), i)``.
      progress: called with the number of prompts each finished batch completed.

    Returns:
      ``texts`` [B * G], ``lengths``, ``truncated`` and ``tokens`` (lists of ids), grouped by
      prompt.
    """
    out: dict[str, list] = {"texts": [], "lengths": [], "truncated": [], "tokens": []}
    key = jax.random.key(seed)
    for i, start in enumerate(range(0, len(messages), batch_size)):
        chunk = messages[start : start + batch_size]
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
        ids, mask = tokenizer.encode_chat(padded)
        res = generate_from_state(
            graphdef,
            states,
            model_cfg,
            sharding.put_batch(ids, mesh),
            sharding.put_batch(mask, mesh),
            settings,
            rng=jax.random.fold_in(key, i),
        )
        keep = len(chunk) * settings.num_samples
        tokens, tmask = sharding.to_host(res.tokens)[:keep], sharding.to_host(res.mask)[:keep]
        stop = sharding.to_host(res.stop_reason)[:keep]
        out["texts"] += tokenizer.batch_decode(tokens, tmask)
        out["lengths"] += tmask.sum(-1).tolist()
        out["truncated"] += (stop == int(StopReason.LENGTH)).tolist()
        out["tokens"] += [t[m > 0].tolist() for t, m in zip(tokens, tmask, strict=True)]
        if progress is not None:
            progress(len(chunk))
    return out


def sample(
    model, tokenizer, messages: list, settings: Settings, mesh, *, greedy=False, progress=None
) -> dict:
    """``complete`` for a model with ``settings``' knobs; ``greedy``: one 4-token greedy reply
    per prompt (the judge's); ``progress`` as ``complete``'s.

    Returns:
      ``texts`` [B * n], ``lengths``, ``truncated`` and ``tokens``, grouped by prompt.
    """
    graphdef, state = nnx.split(model)
    return complete(
        graphdef,
        (state,),
        model.cfg,
        tokenizer,
        messages,
        mesh,
        settings.sampler(tokenizer, greedy=greedy),
        batch_size=settings.batch_size,
        seed=settings.seed,
        progress=progress,
    )
