"""Greedy evaluation of the current policy on held-out examples (strict/lenient accuracy and
format rate, as ``jaxgrpo.rl.accuracy`` defines them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxgrpo import sharding
from jaxgrpo.rl import step_metrics
from jaxgrpo.sampling import generate_from_state


def evaluate(learner: Any, state: Any, examples: Sequence[dict]) -> dict[str, float]:
    """Greedy completions of `examples`: strict/lenient accuracy, format rate, reward, length.

    Examples are processed in batches of `prompts_per_step * group_size` prompts (the training
    batch's row count, so the sharding that fits training fits here), the last batch padded by
    repeating its final example; padding is excluded from the metrics.

    Args:
        learner: the `Learner` (its compiled model, tokenizer, rewards and mesh are used).
        state: the `TrainState` whose parameters are evaluated.
        examples: task examples.

    Returns:
        `jaxgrpo.rl.step_metrics.eval_metrics` of the completions.
    """
    examples = list(examples)
    if not examples:
        return {}
    tok = learner.tokenizer
    n = learner.rl.prompts_per_step * learner.rl.group_size
    texts, lengths, truncated = [], [], []
    for start in range(0, len(examples), n):
        chunk = examples[start : start + n]
        padded = chunk + [chunk[-1]] * (n - len(chunk))
        ids, mask = tok.encode_chat([ex["messages"] for ex in padded])
        out = generate_from_state(
            learner.graphdef,
            (state.params, learner.frozen),
            learner.model_cfg,
            sharding.put_batch(ids, learner.mesh),
            sharding.put_batch(mask, learner.mesh),
            rng=jax.random.key(0),
            max_new_tokens=learner.cfg.sampling.max_new_tokens,
            temperature=0.0,
            eos_ids=tok.eos_ids,
            pad_id=tok.pad_id,
        )
        tokens, out_mask = sharding.to_host(out.tokens), sharding.to_host(out.mask)
        stop = sharding.to_host(out.stop_reason)
        k = len(chunk)
        texts += tok.batch_decode(tokens[:k], out_mask[:k])
        lengths += out_mask[:k].sum(-1).tolist()
        truncated += (stop[:k] == step_metrics.LENGTH).tolist()
    prompts = [tok.apply_chat_template(ex["messages"]) for ex in examples]
    return step_metrics.eval_metrics(
        learner.reward_set, examples, prompts, texts, lengths, truncated
    )
