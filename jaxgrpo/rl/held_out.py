"""Greedy evaluation of the current policy on held-out examples during training (strict and
lenient accuracy and format rate, as ``jaxgrpo.grading.accuracy`` defines them); with tools, greedy
episodes run as in training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxgrpo.core.sharding import to_host
from jaxgrpo.eval.completions import complete, complete_episodes
from jaxgrpo.rewards.inputs import reward_inputs
from jaxgrpo.rl import step_metrics
from jaxgrpo.sampling import SamplerSettings


def sampler_settings(learner: Any) -> SamplerSettings:
    """Greedy completions as long as the rollouts' (``sampling.max_new_tokens``), one per
    prompt, stopping at the tokenizer's stop tokens."""
    max_new_tokens = learner.cfg.sampling.max_new_tokens
    return SamplerSettings.for_tokenizer(
        learner.tokenizer, max_new_tokens=max_new_tokens, temperature=0.0
    )


def evaluate(learner: Any, state: Any, examples: Sequence[dict]) -> dict[str, float]:
    """Greedy completions of ``examples``: strict/lenient accuracy, format rate, reward, length.

    Batches hold ``prompts_per_step * group_size`` prompts (the training batch's row count, so
    the sharding that fits training fits here).

    Args:
        learner: the ``Learner`` (its compiled model, tokenizer, rewards and mesh are used).
        state: the ``TrainState`` whose parameters are evaluated.
        examples: task examples.

    Returns:
        ``jaxgrpo.rl.step_metrics.eval_metrics`` of the completions.
    """
    examples = list(examples)
    if not examples:
        return {}
    if learner.agent is not None:
        return evaluate_episodes(learner, state, examples)
    tok = learner.tokenizer
    messages = [ex["messages"] for ex in examples]
    out = complete(
        learner.programs.graphdef,
        (state.params, learner.programs.frozen),
        learner.programs.model_cfg,
        tok,
        messages,
        learner.mesh,
        sampler_settings(learner),
        batch_size=learner.rl.prompts_per_step * learner.rl.group_size,
    )
    prompts = [tok.apply_chat_template(m) for m in messages]
    step = int(to_host(state.step))  # the evaluated parameters' step, for trainer_state
    inputs = reward_inputs(
        examples,
        1,
        prompts,
        out["texts"],
        out["tokens"],
        step=step,
        max_steps=learner.cfg.steps,
    )
    with learner.reward_set.lock:  # not beside a training batch's scoring (asynchronous runs)
        return step_metrics.eval_metrics(learner.reward_set, inputs, out["truncated"])


def evaluate_episodes(learner: Any, state: Any, examples: Sequence[dict]) -> dict[str, float]:
    """``evaluate`` for a run with tools: one greedy episode per example, with the run's tools,
    environment and limits, scored as in training (the environments' rewards included); the
    accuracy and reward metrics plus ``step_metrics.agent_metrics``."""
    p = learner.programs
    out = complete_episodes(
        p.graphdef,
        (state.params, p.frozen),
        p.model_cfg,
        learner.agent,
        examples,
        learner.mesh,
        sampler_settings(learner),
        batch_size=learner.rl.prompts_per_step * learner.rl.group_size,
    )
    inputs = reward_inputs(
        examples,
        1,
        out["prompts"],
        out["texts"],
        out["tokens"],
        step=int(to_host(state.step)),
        max_steps=learner.cfg.steps,
        episodes=out["episodes"],
        environments=out["environments"],
        prompt_messages=out["chats"],
        model_mask=out["model_mask"],
    )
    with learner.reward_set.lock:
        m = step_metrics.eval_metrics(learner.reward_set, inputs, out["truncated"])
    m.update(step_metrics.agent_metrics(out["episodes"], out["lengths"], out["model_tokens"]))
    return m
