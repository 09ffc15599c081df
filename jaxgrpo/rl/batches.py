"""From a scored rollout to the update's device batch: the scoring passes (reference, old
policy, teacher), the KL in the reward, advantages and the loss mask.

``BatchPreparer.prepare`` is the learner's phase between sampling and the update; it puts the
rollout's arrays on the mesh (packed, the prompts' common prefix split off) and runs the
prefix-shared scoring programs of ``StepPrograms`` over them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxgrpo.core import sharding
from jaxgrpo.models import packing as packing_lib
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl import step_metrics
from jaxgrpo.rl.kl import kl_penalized_rewards
from jaxgrpo.rl.train_state import TrainState


class BatchPreparer:
    """The learner's batch preparation over its programs, mesh and shape buckets.

    Args:
        cfg: the run's `TrainConfig`.
        programs: the run's `StepPrograms`.
        mesh: the learner's mesh.
        buckets: the learner's `ShapeBuckets` (widths only grow: few recompiles).
    """

    def __init__(self, cfg, programs, mesh, buckets: ro.ShapeBuckets):
        self.cfg, self.programs = cfg, programs
        self.mesh, self.buckets = mesh, buckets

    @property
    def rl(self):
        """The run's ``RLConfig``, as the programs were last built with."""
        return self.programs.rl

    def prepare(
        self, state: TrainState, r: ro.Rollout, timer: step_metrics.Timer | None = None
    ) -> tuple[ro.RolloutBatch, dict]:
        """Reference/old log-probs, KL-in-reward, advantages, loss mask -> the device batch.

        The scoring passes count as the "reference" phase of ``timer`` (the teacher's as
        "teacher"), the rest as "update"."""
        timer = timer or step_metrics.Timer()
        with timer("update"):
            inputs, packing, shared, t = self.batch_inputs(r)
        teacher_logp = None
        if self.cfg.teacher.enabled:
            if self.programs.teacher_logprobs is None:
                raise ValueError("cfg.teacher uses a teacher, but the Learner was given none")
            with timer("teacher"):
                teacher_logp = self._teacher_pass(inputs, packing, shared)
        with timer("reference"):
            logps = self._scoring_passes(state, r, inputs, packing, shared, t)
        with timer("update"):
            return self._finish_batch(r, inputs, packing, shared, t, *logps, teacher_logp)

    def batch_inputs(self, r: ro.Rollout) -> tuple:
        """(device inputs, packing, shared prefix, width T) of the scoring passes and update."""
        put = lambda x: sharding.put_batch(x, self.mesh)  # noqa: E731
        packing = None
        if self.rl.pack_completions:
            # Packed scoring reads only each completion's own tokens, so the width of the
            # [R, T] arrays costs next to nothing; keeping it fixed avoids recompiling.
            t = r.tokens.shape[1]
            lengths = r.mask.sum(axis=1)
            packing = packing_lib.pack(lengths, self.rl.group_size, t, self.buckets)
            packing = jax.tree.map(put, packing)
        else:
            t = ro.completion_bucket(r.lengths, r.tokens.shape[1], self.buckets)
        tokens, mask, temps = r.tokens[:, :t], r.mask[:, :t], r.temps[:, :t]
        shared, prompt_ids, prompt_mask = np.zeros((1, 0), np.int32), r.prompt_ids, r.prompt_mask
        if self.rl.share_prompt_prefix:
            shared, prompt_ids, prompt_mask = ro.split_common_prefix(
                prompt_ids, prompt_mask, buckets=self.buckets
            )
        shared = self.programs.replicate(shared, np.int32)
        inputs = (put(prompt_ids), put(prompt_mask), put(tokens), put(mask), put(temps))
        return inputs, packing, shared, t

    def _teacher_pass(self, inputs, packing, shared):
        """The teacher's log-probs [R, T] of the batch, waited for."""
        p = self.programs
        logp = p.teacher_logprobs(*p.teacher_weights, *inputs, packing, shared)[0]
        return jax.block_until_ready(logp)

    def _scoring_passes(self, state: TrainState, r: ro.Rollout, inputs, packing, shared, t):
        """(sampler, old-policy, reference) log-probs [R, T], waited for, so that the phase
        timer counts their compute and not only their dispatch."""
        put = lambda x: sharding.put_batch(x, self.mesh)  # noqa: E731
        sampler_logp = put(r.logprobs[:, :t].astype(np.float32))
        ref_logp = old_logp = put(np.zeros(inputs[2].shape, np.float32))
        p = self.programs
        if p.needs_ref:
            ref_logp = p.logprobs(p.reference(state), p.frozen, *inputs, packing, shared)[0]
        if p.old_from == "forward":
            old_logp = p.logprobs(state.params, p.frozen, *inputs, packing, shared)[0]
        elif p.old_from == "sampler":
            old_logp = sampler_logp
        return jax.block_until_ready((sampler_logp, old_logp, ref_logp))

    def _finish_batch(
        self, r, inputs, packing, shared, t, sampler_logp, old_logp, ref_logp, teacher_logp
    ):
        """KL-in-reward, advantages and the loss mask -> (the device batch, host extras)."""
        put = lambda x: sharding.put_batch(x, self.mesh)  # noqa: E731
        p = self.programs
        trained = r.trained_mask[:, :t]  # the model's own ids: tool results get no loss or KL
        truncated = r.stop_reason == step_metrics.LENGTH
        loss_mask = trained * (~truncated[:, None]) if self.rl.mask_truncated else trained
        rewards = r.rewards
        extra: dict[str, Any] = {}
        kl_in_reward = (p.needs_ref or p.kl_to_teacher) and self.rl.kl_in_reward
        behaviour = None  # on the host only where a teacher or the KL in the reward reads it
        if teacher_logp is not None or kl_in_reward:
            forward = p.old_from == "forward"
            behaviour = sharding.to_host(old_logp) if forward else r.logprobs[:, :t]
        if p.kl_to_teacher:
            ref_logp = teacher_logp
        if teacher_logp is not None:
            extra["teacher"] = step_metrics.teacher_metrics(
                behaviour, sharding.to_host(teacher_logp), trained, r.correct
            )
        if kl_in_reward:
            penalized, kl_R = kl_penalized_rewards(
                rewards, behaviour, sharding.to_host(ref_logp), trained, self.rl.beta
            )
            rewards, extra["kl_in_reward"] = np.asarray(penalized), np.asarray(kl_R)
        adv, adv_metrics = step_metrics.advantages(
            rewards, self.rl.group_size, self.rl.adv_scale, self.rl.baseline
        )
        extra.update(advantages=adv, adv_metrics=adv_metrics, loss_mask=loss_mask)
        batch = ro.RolloutBatch(
            prompt_ids=inputs[0],
            prompt_mask=inputs[1],
            tokens=inputs[2],
            mask=inputs[3],
            loss_mask=put(loss_mask.astype(np.int32)),
            temps=inputs[4],
            sampler_logp=sampler_logp,
            old_logp=old_logp,
            ref_logp=ref_logp,
            advantages=put(adv.astype(np.float32)),
            packing=packing,
            shared_ids=shared,
            teacher_logp=teacher_logp if p.objective.use_teacher_logp else None,
        )
        return batch, extra
