"""Rollouts: prompts -> sampled groups -> decoded text -> rewards, and host/device transfer.

A `Rollout` is the host-side record of one sampling round (numpy arrays and strings), which
the learner scores, filters (dynamic sampling), logs and turns into the device-side
`RolloutBatch` that the scoring passes and the update consume.

Multi-host: every process tokenizes the whole batch of prompts (they are the same on every
host, drawn from the same seeded stream) and JAX gets only the slices its devices hold
(`sharding.put_batch`), so each host feeds its part of the batch. Completions come back to
every host (`sharding.to_host`) so rewards, advantages and metrics are computed identically
everywhere and no host-to-host exchange of Python objects is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import numpy as np

from jaxgrpo.core.shapes import Array
from jaxgrpo.grading import accuracy
from jaxgrpo.models.packing import Packing
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.rewards.inputs import columns_for, model_texts, reward_inputs


class ShapeBuckets:
    """Widths of a run's batches that only grow (or, for the shared prefix, only shrink).

    Every distinct width of a prompt, suffix or packed row is a new compiled program (tens of
    seconds each). Prompts change length as a curriculum fades and completions shorten as the
    policy learns, so widths chosen afresh per step recompile again and again. Holding each
    width at its most demanding value so far bounds the compiles per program by its number of
    buckets (usually one), at the price of some padding. The learner holds one per run.
    """

    def __init__(self):
        self._widths: dict[str, int] = {}

    def grow(self, name: str, width: int) -> int:
        """``width`` or the largest width ``name`` has had, whichever is larger."""
        self._widths[name] = max(width, self._widths.get(name, 0))
        return self._widths[name]

    def shrink(self, name: str, width: int) -> int:
        """``width`` or the smallest width ``name`` has had, whichever is smaller."""
        self._widths[name] = min(width, self._widths.get(name, width))
        return self._widths[name]


def trim_prompts(
    ids_BP: np.ndarray, mask_BP: np.ndarray, buckets: ShapeBuckets | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompts cut (or padded) to a half-octave bucket of the longest one.

    The tokenizer pads to powers of two (87 tokens -> 128); the sampler's prefill and
    attention and both scoring passes then spend that padding on every step. A half-octave
    bucket (96 here) keeps the number of compiled shapes small; with ``buckets`` the width
    never drops below an earlier step's.
    """
    longest = int(mask_BP.sum(axis=1).max(initial=1))
    keep = bucket_length(longest, min_bucket=16, half_octaves=True)
    if buckets is not None:
        keep = buckets.grow("prompt", keep)
    if keep > ids_BP.shape[1]:
        return _left_pad(ids_BP, mask_BP, keep, 0)
    return ids_BP[:, -keep:], mask_BP[:, -keep:]


def split_common_prefix(
    ids_BP: np.ndarray,
    mask_BP: np.ndarray,
    *,
    min_length: int = 16,
    multiple: int = 8,
    buckets: ShapeBuckets | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits left-padded prompts into the tokens they all begin with and their own suffixes.

    GRPO prompts usually share a system prompt and worked examples (format_copy: 76 of its 87
    tokens), and the scoring passes then run that prefix once per batch instead of once per
    prompt. The shared length C is the common prefix rounded down to a multiple of `multiple`
    (so the compiled shapes rarely change from step to step), leaving each prompt at least
    one token of its own (its last one predicts the first completion token).

    Args:
        ids_BP: int32 [B, P] left-padded prompts.
        mask_BP: int32 [B, P], 1 on real tokens.
        min_length: share nothing when fewer tokens would be shared (or B < 2).
        multiple: C is a multiple of this.
        buckets: the run's `ShapeBuckets`: C never exceeds an earlier step's, and S is P - C
            (P is the run's prompt width, `trim_prompts`), so both change only when P or C do.

    Returns:
        (shared_1C, suffix ids [B, S], suffix mask [B, S]): the suffixes left-padded (with 0)
        to a half-octave bucket S. When nothing is shared, C = 0 and the suffixes are the
        prompts unchanged.
    """
    b, p = ids_BP.shape
    lengths_B = mask_BP.sum(axis=1).astype(np.int64)
    nothing = (np.zeros((1, 0), np.int32), ids_BP, mask_BP)
    if b < 2 or int(lengths_B.min()) <= min_length:
        return nothing
    shortest = int(lengths_B.min())
    starts_B = p - lengths_B
    heads_BK = np.stack([ids_BP[i, start : start + shortest] for i, start in enumerate(starts_B)])
    differs = np.flatnonzero(np.any(heads_BK != heads_BK[:1], axis=0))
    common = int(differs[0]) if differs.size else shortest
    c = min(common, shortest - 1) // multiple * multiple
    if buckets is not None:
        c = buckets.shrink("shared", c if c >= min_length else 0)
    if c < min_length:
        return nothing
    own_B = lengths_B - c
    if buckets is None:
        s = bucket_length(int(own_B.max()), min_bucket=8, half_octaves=True)
    else:  # the prompts' (run-wide) width less the (run-wide) prefix: as stable as both
        s = p - c
    ids_BS = np.zeros((b, s), np.int32)
    mask_BS = np.zeros((b, s), np.int32)
    for i, n in enumerate(own_B):
        ids_BS[i, s - n :] = ids_BP[i, p - n :]
        mask_BS[i, s - n :] = 1
    return heads_BK[:1, :c].astype(np.int32), ids_BS, mask_BS


def completion_bucket(
    lengths_R: np.ndarray, max_new_tokens: int, buckets: ShapeBuckets | None = None
) -> int:
    """Columns of the completions the scoring passes need: the longest one's power-of-two bucket.

    Columns past every row's end are masked out of the loss, and a causal model's log-probs of
    the earlier columns do not depend on them, so dropping them changes nothing but the time.
    """
    longest = int(np.max(lengths_R, initial=1))
    t = bucket_length(longest, min_bucket=8, max_length=max_new_tokens)
    return t if buckets is None else buckets.grow("completion", t)


@flax.struct.dataclass
class RolloutBatch:
    """Device arrays of one step's training batch (B prompts, R = B * G completions).

    Attributes:
        prompt_ids: int32 [B, P] left-padded prompts (what follows `shared_ids`).
        prompt_mask: int32 [B, P].
        tokens: int32 [R, T] completions (row b*G + g is sample g of prompt b).
        mask: int32 [R, T] 1 on every completion id, the model's and a tool's (what later ids
            attend).
        loss_mask: int32 [R, T] the ids the loss trains: the model's own (not tool results),
            zeroed for truncated rows when masking.
        temps: float32 [R, T] temperature each token was sampled at.
        sampler_logp: float32 [R, T] log-probs reported by the sampler.
        old_logp: float32 [R, T] behaviour log-probs from a trainer forward pass (zeros when
            the update is on-policy and does not need them).
        ref_logp: float32 [R, T] reference log-probs (zeros when there is no KL term).
        advantages: float32 [R].
        packing: `Packing` of the groups' completions for the scoring passes, or None to score
            each completion in its own row.
        shared_ids: int32 [1, C] tokens every prompt begins with (`split_common_prefix`);
            `prompt_ids` then hold only what follows them. None or C = 0: nothing shared.
        teacher_logp: float32 [R, T] a teacher's log-probs of the completions, for the
            distillation term; None without one.
    """

    prompt_ids: Array
    prompt_mask: Array
    tokens: Array
    mask: Array
    loss_mask: Array
    temps: Array
    sampler_logp: Array
    old_logp: Array
    ref_logp: Array
    advantages: Array
    packing: Packing | None = None
    shared_ids: Array | None = None
    teacher_logp: Array | None = None


@dataclasses.dataclass
class Rollout:
    """Host-side record of sampled groups.

    Attributes:
        examples: the B task examples.
        prompt_ids / prompt_mask: int32 [B, P].
        tokens / mask / logprobs / temps: [R, T] sampler outputs.
        stop_reason / lengths: int32 [R].
        prompts / completions: R prompt texts (rendered chat) and decoded completions.
        rewards: float32 [R] weighted total; per_fn: name -> float32 [R] raw values (NaN where
            a function returned None); weights: name -> weight used this step.
        correct: bool [R] strict correctness, or None when the task has no notion of it.
        model_mask: int32 [R, T] 1 on the ids the model drew, 0 on tool results and padding;
            None: every id of ``mask`` (single-turn completions).
        episodes: R ``jaxgrpo.agents.Episode`` records (turns, calls, results), or None.
        environments: R environment instances, one per episode, or None.
        versions: int32 [R, T] the policy version (updates applied) that drew each id, -1 on
            tool results and padding (`Learner.collect_batch` records it); None: not recorded.
    """

    examples: list[dict]
    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    temps: np.ndarray
    stop_reason: np.ndarray
    lengths: np.ndarray
    prompts: list[str]
    completions: list[str]
    rewards: np.ndarray
    per_fn: dict[str, np.ndarray]
    weights: dict[str, float]
    correct: np.ndarray | None
    model_mask: np.ndarray | None = None
    episodes: list | None = None
    environments: list | None = None
    versions: np.ndarray | None = None

    @property
    def model_completions(self) -> list[str]:
        """R texts the model wrote (``rewards.inputs.model_texts``): what accuracy grades; with
        tools, the completions without the tools' results."""
        return model_texts(self.completions, self.episodes)

    @property
    def tool_lengths(self) -> np.ndarray:
        """int [R] ids of the tools' results per completion (0 without tools)."""
        return (self.mask.sum(axis=1) - self.trained_mask.sum(axis=1)).astype(np.int32)

    @property
    def model_lengths(self) -> np.ndarray:
        """int [R] ids the model drew per completion (``completion/length``, as TRL's):
        ``lengths`` without tools."""
        if self.model_mask is None:
            return self.lengths.astype(np.int32)
        return self.model_mask.sum(axis=1).astype(np.int32)

    @property
    def trained_mask(self) -> np.ndarray:
        """[R, T] the ids the loss may train: the model's own."""
        return self.mask if self.model_mask is None else self.model_mask

    @property
    def group_size(self) -> int:
        return self.tokens.shape[0] // self.prompt_ids.shape[0]

    def zero_variance_groups(self) -> np.ndarray:
        """bool [B]: groups whose rewards are all equal (no GRPO signal)."""
        r_BG = self.rewards.reshape(-1, self.group_size)
        return np.all(r_BG == r_BG[:, :1], axis=1)

    def select_groups(self, keep_B: np.ndarray) -> Rollout:
        """The rollout restricted to the groups at indices `keep_B` (in that order)."""
        g = self.group_size
        rows = (np.asarray(keep_B)[:, None] * g + np.arange(g)).reshape(-1)
        return _take(self, np.asarray(keep_B), rows)


def _take(r: Rollout, groups: np.ndarray, rows: np.ndarray) -> Rollout:
    return Rollout(
        examples=[r.examples[i] for i in groups],
        prompt_ids=r.prompt_ids[groups],
        prompt_mask=r.prompt_mask[groups],
        tokens=r.tokens[rows],
        mask=r.mask[rows],
        logprobs=r.logprobs[rows],
        temps=r.temps[rows],
        stop_reason=r.stop_reason[rows],
        lengths=r.lengths[rows],
        prompts=[r.prompts[i] for i in rows],
        completions=[r.completions[i] for i in rows],
        rewards=r.rewards[rows],
        per_fn={k: v[rows] for k, v in r.per_fn.items()},
        weights=r.weights,
        correct=None if r.correct is None else r.correct[rows],
        model_mask=None if r.model_mask is None else r.model_mask[rows],
        episodes=None if r.episodes is None else [r.episodes[i] for i in rows],
        environments=None if r.environments is None else [r.environments[i] for i in rows],
    )


def _left_pad(ids: np.ndarray, mask: np.ndarray, length: int, pad_id: int):
    extra = length - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (
        np.pad(ids, ((0, 0), (extra, 0)), constant_values=pad_id),
        np.pad(mask, ((0, 0), (extra, 0))),
    )


def concat(rollouts: Sequence[Rollout], pad_id: int) -> Rollout:
    """Concatenates rollouts group-wise, left-padding prompts to the longest bucket."""
    if len(rollouts) == 1:
        return rollouts[0]
    p = max(r.prompt_ids.shape[1] for r in rollouts)
    padded = [_left_pad(r.prompt_ids, r.prompt_mask, p, pad_id) for r in rollouts]

    def cat(name):
        return np.concatenate([getattr(r, name) for r in rollouts], axis=0)

    correct = None if rollouts[0].correct is None else cat("correct")

    def join(name):  # a list per row, or None
        if getattr(rollouts[0], name) is None:
            return None
        return [x for r in rollouts for x in getattr(r, name)]

    return Rollout(
        examples=[e for r in rollouts for e in r.examples],
        prompt_ids=np.concatenate([ids for ids, _ in padded]),
        prompt_mask=np.concatenate([m for _, m in padded]),
        tokens=cat("tokens"),
        mask=cat("mask"),
        logprobs=cat("logprobs"),
        temps=cat("temps"),
        stop_reason=cat("stop_reason"),
        lengths=cat("lengths"),
        prompts=[p for r in rollouts for p in r.prompts],
        completions=[c for r in rollouts for c in r.completions],
        rewards=cat("rewards"),
        per_fn={k: np.concatenate([r.per_fn[k] for r in rollouts]) for k in rollouts[0].per_fn},
        weights=rollouts[0].weights,
        correct=correct,
        model_mask=None if rollouts[0].model_mask is None else cat("model_mask"),
        episodes=join("episodes"),
        environments=join("environments"),
    )


def score(
    reward_set: Any,
    task_name: str,
    examples: Sequence[dict],
    prompts: list[str],
    completions: list[str],
    group_size: int,
    step: int,
    *,
    sampled: dict[str, np.ndarray],
    max_failed_steps: int | None = None,
    max_steps: int = 0,
    episodes: Sequence[Any] | None = None,
    environments: Sequence[Any] | None = None,
    prompt_messages: Sequence[list[dict]] | None = None,
):
    """Runs the reward set and the strict-correctness check on R completions.

    Reward functions get TRL's keyword arguments, built by ``jaxgrpo.rewards.reward_inputs``
    as in every other caller; strict correctness grades what the model wrote
    (``RewardInputs.model_completions``), never a tool's output.

    Args:
        sampled: the sampler's host arrays: `tokens` and `mask` [R, T], and `model_mask`
            [R, T] with tools.
        max_failed_steps: `rewards.max_failed_steps` (training), or None.
        max_steps: the run's `steps`, for `trainer_state.max_steps`.
        episodes / environments / prompt_messages: a tool-calling run's episode records,
            environment instances and the chats they started from (``reward_inputs``).

    Returns:
        (total float32 [R], per_fn name -> float32 [R], weights, correct bool [R] or None).
    """
    rows = zip(sampled["tokens"], sampled["mask"], strict=True)
    ids = [t[m.astype(bool)] for t, m in rows]
    model_mask = None
    if sampled.get("model_mask") is not None:
        rows = zip(sampled["model_mask"], sampled["mask"], strict=True)
        model_mask = [mm[m.astype(bool)] for mm, m in rows]
    inputs = reward_inputs(
        examples,
        group_size,
        prompts,
        completions,
        ids,
        step=step,
        max_steps=max_steps,
        episodes=episodes,
        environments=environments,
        prompt_messages=prompt_messages,
        model_mask=model_mask,
    )
    total, per_fn, weights = reward_set.score(inputs, max_failed_steps=max_failed_steps)
    total = np.nan_to_num(np.asarray(total, np.float32))
    per_fn = {k: np.asarray(v, np.float32) for k, v in per_fn.items()}
    graded = inputs.model_completions
    correct = accuracy.strict_correct(task_name, graded, columns_for(examples, group_size))
    return total, per_fn, dict(weights), correct
