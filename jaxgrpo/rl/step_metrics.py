"""Host-side metrics of a training step and of an evaluation pass.

Key names (the logger's progress bar and dead-run check read the first group):

    reward/mean, reward/std, kl/mean, completion/truncated_frac,
    time/{sampling,rewards,reference,update}   seconds per phase (reference: the scoring passes)
    time/teacher                seconds of the teacher's scoring pass (runs with a teacher)
    time/eval                   seconds of the held-out evaluation (rows with eval/*)
    reward/<fn>/mean, reward/<fn>/std, reward/<fn>/weight   raw value of each reward function
    reward/<fn>/failed_frac     fraction of samples the function could not score (raised/None)
    strict_accuracy, lenient_accuracy, format_rate   jaxgrpo.grading.accuracy of what the model
                                wrote (never a tool's output), when the task has an answer
                                column (held out, eval_metrics: the same names)
    adv/{mean,std,min,max}, adv/frac_zero_std_groups
    completion/length_mean, completion/length_correct, completion/length_incorrect   ids the
                                model drew (TRL's completion length: tools' results not counted)
    completion/tool_length_mean ids of the tools' results per completion (runs with tools)
    completion/stop_<reason>_frac    LENGTH / STOP_TOKEN / REPETITION
    entropy, loss, policy_loss, kl_loss, clip_frac{,_low,_high}, ratio_{mean,min,max},
    grad_norm, sampler_logp_gap{,_max}, update_skipped       averaged over the step's updates
    lag/{is_weight_mean,is_weight_max,is_clipped_frac,ess}   asynchronous runs
                                (rl.max_staleness >= 1): the lag correction's weights w on
                                the trained tokens (for "clip", r = pi_learner / pi_sampler),
                                the fraction truncated, masked or outside the clip range,
                                and (sum w)^2 / (n sum w^2); the max over updates, else means
    updates, micro_batches      optimizer updates of the step; micro-batches in each
                                (`Learner.micro_batches`)
    tokens_per_s                generated tokens per second of sampling
    agent/{tool_calls,turns,truncated_results,failed,failed_frac}, agent/failed/<kind>,
    agent/{model,tool}_tokens   episodes with tools (`agent_metrics`), per episode
    teacher/reverse_kl{,_correct,_incorrect}   per-token reverse KL to the teacher
                                (`teacher_metrics`); distill_reverse_kl: the update's value
    flops/step_est, flops/tflops_per_s   model FLOPs of the step (2 x params per token forward,
                                6 x forward+backward; attention ignored) and their rate
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxgrpo import agents
from jaxgrpo.core.sharding import to_host
from jaxgrpo.grading import accuracy
from jaxgrpo.rewards.inputs import RewardInputs, columns_for
from jaxgrpo.rl.advantages import group_advantages
from jaxgrpo.rl.rollout import Rollout
from jaxgrpo.sampling import StopReason

LENGTH = int(StopReason.LENGTH)
_UPDATE_RENAMES = {"kl_mean": "kl/mean", "entropy_mean": "entropy"}
_UPDATE_MINMAX = {
    "ratio_min": min,
    "ratio_max": max,
    "sampler_logp_gap_max": max,
    "lag/is_weight_max": max,
}


class Timer:
    """Accumulates wall time per phase (`with timer("sampling"): ...`) and generated tokens;
    ``spans`` keeps each phase's (start, end) times, which asynchronous rollouts compare with
    the learner's (``async/overlap/<phase>``)."""

    def __init__(self):
        self.seconds = {"sampling": 0.0, "rewards": 0.0, "reference": 0.0, "update": 0.0}
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.tokens = 0

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + t1 - t0
            self.spans.setdefault(phase, []).append((t0, t1))

    def add_tokens(self, n: int) -> None:
        self.tokens += n


def advantages(
    rewards: np.ndarray, group_size: int, scale: str, baseline: str = "mean"
) -> tuple[np.ndarray, dict]:
    """Group advantages (jaxgrpo.rl.advantages) as numpy, plus their summary statistics."""
    adv, m = group_advantages(
        np.asarray(rewards, np.float32), group_size, scale, baseline=baseline, return_metrics=True
    )
    adv = np.asarray(adv, np.float32)
    metrics = {
        "adv/mean": float(adv.mean()),
        "adv/std": float(adv.std()),
        "adv/min": float(adv.min()),
        "adv/max": float(adv.max()),
        "adv/frac_zero_std_groups": float(m["frac_zero_std_groups"]),
    }
    return adv, metrics


def reduce_updates(history: Sequence[dict]) -> dict:
    """Per-update metric dicts (device scalars) -> one dict: means, or min/max where apt."""
    host = [{k: float(to_host(v)) for k, v in h.items()} for h in history]
    out = {}
    for key in host[0]:
        values = [h[key] for h in host]
        reduce = _UPDATE_MINMAX.get(key)
        out[_UPDATE_RENAMES.get(key, key)] = reduce(values) if reduce else float(np.mean(values))
    # The policy only equals the sampler's at the first update of the step.
    out["sampler_logp_gap"] = host[0]["sampler_logp_gap"]
    out["updates"] = float(len(host))
    return out


def _mean(x) -> float:
    x = np.asarray(x, np.float64)
    return float(x.mean()) if x.size else math.nan


def _std(x) -> float:
    x = np.asarray(x, np.float64)
    return float(x.std(ddof=1)) if x.size > 1 else 0.0


def step_metrics(r: Rollout, extra: dict, update: dict, seconds: dict) -> dict[str, float]:
    """All scalar metrics of one step (see the module docstring for the keys)."""
    m: dict[str, float] = {"reward/mean": _mean(r.rewards), "reward/std": _std(r.rewards)}
    for name, values in r.per_fn.items():
        finite = values[np.isfinite(values)]
        m[f"reward/{name}/mean"] = _mean(finite)
        m[f"reward/{name}/std"] = _std(finite)
        m[f"reward/{name}/weight"] = float(r.weights.get(name, math.nan))
        m[f"reward/{name}/failed_frac"] = _mean(np.isnan(values))  # raised or returned None
    lengths = r.model_lengths.astype(np.float64)
    m["completion/length_mean"] = _mean(lengths)
    if r.model_mask is not None:
        m["completion/tool_length_mean"] = _mean(r.tool_lengths)
    if r.correct is not None:
        columns = columns_for(r.examples, r.group_size)
        m.update(accuracy.rates(r.model_completions, columns, r.correct))
        m["completion/length_correct"] = _mean(lengths[r.correct])
        m["completion/length_incorrect"] = _mean(lengths[~r.correct])
    m["completion/truncated_frac"] = _mean(r.stop_reason == LENGTH)
    for reason in StopReason:
        m[f"completion/stop_{reason.name.lower()}_frac"] = _mean(r.stop_reason == int(reason))
    if r.episodes is not None:
        m.update(agent_metrics(r.episodes, r.mask.sum(axis=1), r.trained_mask.sum(axis=1)))
    m.update(extra.get("teacher", {}))
    if "kl_in_reward" in extra:
        m["kl/in_reward_mean"] = _mean(extra["kl_in_reward"])
    m.update(extra["adv_metrics"])
    m.update(update)
    m.setdefault("kl/mean", 0.0)
    m.update({f"time/{k}": v for k, v in seconds.items()})
    m["tokens_per_s"] = float(r.trained_mask.sum()) / max(seconds.get("sampling", 0.0), 1e-9)
    return m


def teacher_metrics(
    behaviour_RT: np.ndarray, teacher_RT: np.ndarray, trained_RT: np.ndarray, correct_R
) -> dict[str, float]:
    """The per-token reverse KL to the teacher, ``log pi_student - log pi_teacher`` on the
    student's sampled ids (the model's own: tool results excluded): its mean over tokens, and
    the mean of each completion's token mean over correct and incorrect completions."""
    w_RT = np.asarray(trained_RT, np.float64)
    kl_RT = np.where(w_RT > 0, np.asarray(behaviour_RT, np.float64) - teacher_RT, 0.0)
    per_R = kl_RT.sum(axis=1) / np.maximum(w_RT.sum(axis=1), 1.0)
    m = {"teacher/reverse_kl": float(kl_RT.sum() / max(w_RT.sum(), 1.0))}
    if correct_R is not None:
        correct_R = np.asarray(correct_R, bool)
        m["teacher/reverse_kl_correct"] = _mean(per_R[correct_R])
        m["teacher/reverse_kl_incorrect"] = _mean(per_R[~correct_R])
    return m


def agent_metrics(episodes: Sequence[Any], lengths, model_tokens) -> dict:
    """``agents.metrics`` of the episodes (calls, turns, failures by kind, cut results), and
    ``agent/model_tokens`` / ``agent/tool_tokens``: ids per episode the model drew and the
    tools' results took (``lengths``: ids per episode; ``model_tokens``: the model's)."""
    m = agents.metrics(episodes)
    lengths, model_tokens = np.asarray(lengths), np.asarray(model_tokens)
    m["agent/model_tokens"] = _mean(model_tokens)
    m["agent/tool_tokens"] = _mean(lengths - model_tokens)
    return m


def flop_metrics(
    n_params: int,
    r: Rollout,
    fwd_passes: int,
    train_passes: int,
    seconds: float,
    teacher_params: int = 0,
):
    """Estimated model FLOPs of a step: sampling, `fwd_passes` scoring-only passes (reference,
    old policy), `train_passes` forward+backward passes and a teacher's scoring pass (of
    `teacher_params`), all over the prompt once per group (prefix sharing) plus every
    completion token."""
    prompt_tokens = float(r.prompt_mask.sum())
    completion_tokens = float(r.mask.sum())
    scored = prompt_tokens + completion_tokens
    flops = 2.0 * n_params * scored  # sampling: prefill + decode
    flops += (2.0 * fwd_passes + 6.0 * train_passes) * n_params * scored
    flops += 2.0 * teacher_params * scored
    return {"flops/step_est": flops, "flops/tflops_per_s": flops / max(seconds, 1e-9) / 1e12}


def samples(r: Rollout, adv: np.ndarray, step: int) -> list[dict[str, Any]]:
    """One JSON-able dict per completion, for `samples.jsonl`."""
    out = []
    for i, (prompt, completion) in enumerate(zip(r.prompts, r.completions, strict=True)):
        row = {
            "step": step,
            "group": i // r.group_size,
            "prompt": prompt,
            "completion": completion,
            "reward": float(r.rewards[i]),
            "rewards": {k: float(v[i]) for k, v in r.per_fn.items()},
            "advantage": float(adv[i]),
            "length": int(r.lengths[i]),
            "stop_reason": StopReason(int(r.stop_reason[i])).name,
        }
        if r.correct is not None:
            row["correct"] = bool(r.correct[i])
        if r.versions is not None:  # the policy version that drew it (updates applied)
            row["policy_version"] = int(r.versions[i].max(initial=-1))
        if r.episodes is not None:
            row["turns"] = agents.turn_records(r.episodes[i])
            row["model_tokens"] = int(r.trained_mask[i].sum())
        out.append(row)
    return out


def eval_metrics(reward_set: Any, inputs: RewardInputs, truncated: Sequence[bool]) -> dict:
    """Strict/lenient accuracy and format rate (``jaxgrpo.grading.accuracy``) of what the model
    wrote, reward and length of one completion per example, the rewards called as in training
    (``RewardSet.score``). ``length_mean`` counts the model's ids; ``tool_length_mean`` (with
    tools) the tools' results'."""
    total, per_fn, _ = reward_set.score(inputs)
    m = {
        "num_examples": float(len(inputs.completions)),
        "reward_mean": _mean(np.nan_to_num(np.asarray(total, np.float64))),
        "length_mean": _mean(inputs.lengths),
        "truncated_frac": _mean(truncated),
    }
    if inputs.model_lengths is not None:
        every = np.asarray(inputs.columns["completion_lengths"], np.float64)
        m["tool_length_mean"] = _mean(every - np.asarray(inputs.model_lengths, np.float64))
    for name, values in per_fn.items():
        values = np.asarray(values, np.float64)
        m[f"reward/{name}/mean"] = _mean(values[np.isfinite(values)])
        m[f"reward/{name}/failed_frac"] = _mean(np.isnan(values))
    m.update(accuracy.rates(inputs.model_completions, inputs.columns))
    return m
