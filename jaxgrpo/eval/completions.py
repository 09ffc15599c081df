"""Completions of many prompts in fixed-shape batches over the mesh: the one generation loop of
evaluation, for a model (``sample``) and for the learner's split state (``held_out``); with an
agent's tools, episodes of several turns (``complete_episodes``) over the same sampler
(``mesh_sampler``), which the learner's rollouts use too."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxgrpo.core import sharding
from jaxgrpo.rewards.inputs import model_texts
from jaxgrpo.sampling import SamplerSettings, StopReason, generate_from_state, resume_from_state

SAMPLE_FIELDS = ("tokens", "mask", "logprobs", "temperatures", "stop_reason", "lengths")

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
        sample = mesh_sampler(
            graphdef, states, model_cfg, mesh, settings, jax.random.fold_in(key, i)
        )
        res = sample(ids, mask, settings.num_samples, settings.max_lengths, 0)
        keep = len(chunk) * settings.num_samples
        tokens, tmask, stop = res["tokens"][:keep], res["mask"][:keep], res["stop_reason"][:keep]
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


def mesh_sampler(
    graphdef: Any,
    states: Sequence[Any],
    model_cfg: Any,
    mesh: Any,
    settings: SamplerSettings,
    key,
    *,
    keep_cache: bool = False,
) -> Callable[..., dict[str, np.ndarray]]:
    """``sample(ids [N, P], mask, num_samples, max_lengths, turn, resume=None)`` -> host arrays
    of ``SAMPLE_FIELDS`` [N * num_samples, T]: ``settings`` with the call's samples per prompt
    and per-row lengths, on the mesh, turn k drawing with ``fold_in(key, k)`` (turn 0 with
    ``key``). Rows are padded to split over the mesh's batch shards (an episode's later turns
    sample only the rows that called a tool); the padding's samples are dropped.

    With ``keep_cache`` (episodes of several turns) each call keeps its KV cache on the
    devices, and a call with a ``jaxgrpo.agents.rollout.Resume`` continues the rows it names
    from it (``resume_from_state``), prefilling only the ids appended since, not ``ids``."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    settings = dataclasses.replace(settings, keep_cache=keep_cache)
    kept: dict[str, Any] = {}
    # One key type and placement for every caller (a raw key, whole on every device), so the
    # held-out episodes' later turns run the programs the training's compiled.
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if not isinstance(getattr(key, "sharding", None), NamedSharding):  # a key of this process
        key = sharding.put_whole(key, mesh)

    def padded(x, extra, fill=None):
        x = np.asarray(x)
        tail = np.repeat(x[:1], extra, axis=0) if fill is None else np.full(extra, fill, x.dtype)
        return np.concatenate([x, tail]) if extra else x

    def sample(ids, mask, num_samples, max_lengths, turn, resume=None):
        n = ids.shape[0] if resume is None else resume.ids.shape[0]
        extra = -n % shards
        if np.ndim(max_lengths) == 1:  # per prompt or per sample (a scalar is every row's)
            per_sample = np.size(max_lengths) == n * num_samples and num_samples > 1
            max_lengths = padded(max_lengths, extra * (num_samples if per_sample else 1), 1)
        s = dataclasses.replace(settings, num_samples=num_samples, max_lengths=max_lengths)
        rng = key if turn == 0 else jax.random.fold_in(key, turn)
        put = lambda x: sharding.put_batch(padded(x, extra), mesh)  # noqa: E731
        if resume is None:
            out = generate_from_state(graphdef, states, model_cfg, put(ids), put(mask), s, rng=rng)
        else:
            r = resume
            out = resume_from_state(
                graphdef, states, model_cfg, kept.pop("cache"), r.rows, r.valid_until,
                r.positions, r.ids, r.mask, r.width, s, rng=rng, put=put,
            )  # fmt: skip
        if keep_cache:
            kept["cache"] = out.cache
        rows = n * num_samples
        return {k: sharding.to_host(getattr(out, k))[:rows] for k in SAMPLE_FIELDS}

    return sample


def episode_arrays(agent: Any, sample: Callable, toolboxes, ids, mask, group: int, t: int):
    """(host arrays as ``mesh_sampler``'s plus ``model_mask``, the episode records, the
    environments or None) of the ``agent``'s episodes from prompts [B, P], ``group`` per
    prompt, ``t`` tokens each."""
    b = agent.run(
        lambda *args: types.SimpleNamespace(**sample(*args)),
        toolboxes,
        ids,
        mask,
        group=group,
        max_new_tokens=t,
    )
    stop = np.where(b.truncated, int(StopReason.LENGTH), int(StopReason.STOP_TOKEN))
    host = {
        "tokens": b.tokens,
        "mask": b.mask,
        "model_mask": b.model_mask,
        "logprobs": b.logprobs,
        "temperatures": b.temperatures,
        "stop_reason": stop.astype(np.int32),
        "lengths": b.lengths,
    }
    return host, b.episodes, b.environments


def complete_episodes(
    graphdef: Any,
    states: Sequence[Any],
    model_cfg: Any,
    agent: Any,
    examples: Sequence[dict],
    mesh: Any,
    settings: SamplerSettings,
    *,
    batch_size: int,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list]:
    """``complete`` for a run with tools: ``settings.num_samples`` episodes per example with the
    ``agent``'s tools, environments and limits, ``batch_size`` examples per batch (the last
    padded with its final example, so every batch has one shape).

    Returns:
      ``complete``'s lists, grouped by example (``texts``: whole episodes), and ``model_texts``
      (what the model wrote of each, without the tools' results: what accuracy grades),
      ``model_tokens`` (ids the model drew per episode, the rest being tool results),
      ``episodes`` (``jaxgrpo.agents.Episode``),
      ``environments`` (None without an environment), ``chats`` and ``prompts`` (per example:
      the chat the episodes started from, and its text as the model read it, with the tools
      where the template renders them) and ``model_mask`` (per episode, over its ids).
    """
    g = settings.num_samples
    out: dict[str, list] = {
        k: []
        for k in ("texts", "lengths", "truncated", "tokens", "model_tokens", "episodes", "chats")
    }
    out["model_texts"], out["prompts"] = [], []
    out["model_mask"], environments = [], []
    key = jax.random.key(seed)
    # Calling turns end at the format's stop strings, inside the compiled decode loop.
    stopping = settings.with_stop_strings(agent.tokenizer, agent.format.stop_strings())
    for i, start in enumerate(range(0, len(examples), batch_size)):
        chunk = list(examples[start : start + batch_size])
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
        chats, toolboxes = agent.start(padded, g)
        tools = agent.prompt_tools(padded)
        ids, mask = agent.tokenizer.encode_chat(chats, tools=tools)
        sample = mesh_sampler(
            graphdef, states, model_cfg, mesh, stopping, jax.random.fold_in(key, i),
            keep_cache=agent.keeps_cache,
        )  # fmt: skip
        host, episodes, envs = episode_arrays(
            agent, sample, toolboxes, ids, mask, g, settings.max_new_tokens
        )
        keep = len(chunk) * g
        tokens, tmask = host["tokens"][:keep], host["mask"][:keep]
        out["texts"] += agent.tokenizer.batch_decode(tokens, tmask)
        out["lengths"] += tmask.sum(-1).tolist()
        out["truncated"] += (host["stop_reason"][:keep] == int(StopReason.LENGTH)).tolist()
        out["tokens"] += [t[m > 0].tolist() for t, m in zip(tokens, tmask, strict=True)]
        model_mask = host["model_mask"][:keep]
        out["model_mask"] += [mm[m > 0].tolist() for mm, m in zip(model_mask, tmask, strict=True)]
        out["model_tokens"] += model_mask.sum(-1).tolist()
        out["episodes"] += episodes[:keep]
        out["model_texts"] += model_texts(out["texts"][-keep:], episodes[:keep])
        out["chats"] += chats[: len(chunk)]
        out["prompts"] += [
            agent.tokenizer.apply_chat_template(c, tools=None if tools is None else tools[j])
            for j, c in enumerate(chats[: len(chunk)])
        ]
        environments += (envs or [])[:keep]
        if progress is not None:
            progress(len(chunk))
    out["environments"] = environments if agent.environment is not None else None
    return out


def sample_episodes(
    model, agent, examples: Sequence[dict], settings: Settings, mesh, *, progress=None
) -> dict:
    """``complete_episodes`` for a model with ``settings``' knobs."""
    graphdef, state = nnx.split(model)
    return complete_episodes(
        graphdef,
        (state,),
        model.cfg,
        agent,
        examples,
        mesh,
        settings.sampler(agent.tokenizer),
        batch_size=settings.batch_size,
        seed=settings.seed,
        progress=progress,
    )
