"""Greedy evaluation of the current policy on held-out examples during training (strict and
lenient accuracy and format rate, as ``jaxgrpo.grading.accuracy`` defines them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxgrpo.core.sharding import to_host
from jaxgrpo.eval.completions import complete
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
    return step_metrics.eval_metrics(learner.reward_set, inputs, out["truncated"])
