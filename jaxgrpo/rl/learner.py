"""One GRPO training step, as a readable loop over compiled programs.

    examples --chat template--> prompts [B, P] --sampler (prefill + decode)--> completions [R, T]
      --decode + rewards (host)--> rewards [R] --(dynamic sampling: refill zero-variance groups)
      --reference log-probs (LoRA zeroed, prefix-shared; skipped when beta == 0)
      --teacher log-probs (a second frozen model, same pass; with `teacher`)
      --KL in reward (optional)--> group advantages [R]
      --ppo_epochs x shuffled minibatches of groups x grad-accum micro-batches--> optax updates

The programs (the sampler's prefill and decode, the prefix-shared scoring pass and the update)
and the weights they share are ``jaxgrpo.rl.programs.StepPrograms``; each compiles once per
shape bucket, so a second step with the same buckets compiles nothing. The step's phases are
public (``collect``, ``prepare``, ``optimize``), so benchmarks time them one by one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxgrpo.agents.rollout import warm_later_turns
from jaxgrpo.core import sharding
from jaxgrpo.core.host import release_freed_memory
from jaxgrpo.eval.completions import episode_arrays, mesh_sampler
from jaxgrpo.models import packing as packing_lib
from jaxgrpo.rl import held_out, step_metrics
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl.kl import kl_penalized_rewards
from jaxgrpo.rl.programs import StepPrograms
from jaxgrpo.rl.train_state import (
    TrainState,
)
from jaxgrpo.sampling import SamplerSettings, schedules

Draw = Callable[[int], Sequence[dict]]


class Learner:
    """Applies one training step at a time with a run's ``StepPrograms``.

    Args:
        cfg: the run's `TrainConfig`.
        model: the policy `Transformer`, placed on `mesh` (or abstract: see `StepPrograms`).
        tokenizer: `jaxgrpo.models.tokenizer.Tokenizer` with a chat template.
        task: the task (its name selects the accuracy rule).
        reward_set: `jaxgrpo.rewards.RewardSet`.
        mesh: the (data, fsdp, tensor) mesh; None makes one over all devices on `data`.
        agent: a `jaxgrpo.agents.Agent`: rollouts are episodes of several turns with its tools
            (tool results masked from the loss); None: one completion per sample.
        teacher: the frozen teacher `Transformer` when `cfg.teacher` uses one (its tokenizer
            is the policy's), else None.

    Attributes:
        programs: the step's compiled programs, their shardings and the frozen weights.
        sampler: the rollouts' sampler settings (a step samples at its own temperature).
        buckets: the batch widths seen so far (they only grow: few recompiles).
    """

    def __init__(
        self, cfg, model, tokenizer, task, reward_set, mesh=None, agent=None, teacher=None
    ):
        self.cfg, self.rl, self.agent = cfg, cfg.rl, agent
        self.tokenizer, self.task, self.reward_set = tokenizer, task, reward_set
        self.mesh = mesh if mesh is not None else sharding.make_mesh({"data": -1})
        self.programs = StepPrograms(cfg, model, self.mesh, teacher)
        # An agent's calling turns end at its format's stop strings (the tag format's
        # closing tags), inside the compiled decode loop.
        stops = agent.format.stop_strings() if agent is not None else ()
        self.sampler = SamplerSettings.from_config(
            cfg.sampling, tokenizer, num_samples=self.rl.group_size, stop_strings=stops
        )
        # step -> the step's temperature; step -> the rollout's (per position where scheduled)
        self.step_temperature, self._temperature = schedules.rollout_temperatures(
            cfg.sampling, cfg.steps
        )
        self.buckets = ro.ShapeBuckets()
        self._warm: set[tuple[int, ...]] = set()  # prompt shapes whose later turns compiled

    def init_state(self) -> TrainState:
        """A fresh state: initial trainable params, optimizer state, step 0, seeded RNG."""
        return self.programs.init_state(self.cfg.seed)

    # ------------------------------------------------------------------------------------------
    # The step.

    def step(
        self, state: TrainState, examples: Sequence[dict], draw: Draw | None = None
    ) -> tuple[TrainState, dict[str, float], list[dict]]:
        """One training step on `examples` (B task examples).

        Args:
            state: the current state (donated: do not reuse it afterwards).
            examples: `rl.prompts_per_step` examples.
            draw: `draw(n)` returns n more examples; dynamic sampling uses it to refill groups
                whose rewards are all equal (without it, such groups are kept).

        Returns:
            (new state, metrics of scalars, samples: one dict per completion).
        """
        t_start = time.perf_counter()
        step = int(sharding.to_host(state.step))
        state = self._maybe_reset_reference(state, step)
        next_step, next_rng, k_sample, k_shuffle = self.programs.advance(state.step, state.rng)
        timer = step_metrics.Timer()
        self._end_phase()
        self.reward_set.forget_logged()
        rollout, draws = self.collect(state, list(examples), k_sample, step, draw, timer)
        self._end_phase()
        batch, extra = self.prepare(state, rollout, timer)
        self._end_phase()
        with timer("update"):
            state, update_metrics = self.optimize(state, batch, k_shuffle)
        state = state.replace(step=next_step, rng=next_rng)
        metrics = step_metrics.step_metrics(rollout, extra, update_metrics, timer.seconds)
        # What reward functions reported with TRL's log_metric (a reward model's time): means.
        logged = self.reward_set.logged_metrics.items()
        metrics.update({name: float(np.mean(values)) for name, values in logged if values})
        metrics.update(
            draws=float(draws),
            lr=float(self.programs.schedule(step * self.programs.updates_per_step)),
            temperature=self.step_temperature(step),
            skipped_updates=float(sharding.to_host(state.skipped)),
        )
        metrics["time/step_learner"] = time.perf_counter() - t_start
        p = self.programs
        fwd = int(p.needs_ref) + int(p.old_from == "forward")
        passes, seconds = (fwd, p.updates_per_step), metrics["time/step_learner"]
        flops = step_metrics.flop_metrics(p.n_params, rollout, *passes, seconds, p.n_teacher_params)
        metrics.update(flops)
        return state, metrics, step_metrics.samples(rollout, extra["advantages"], step)

    def _end_phase(self) -> None:
        """Between a step's phases: where the layout says so (`Layout.release_memory`), the
        heap's freed pages go back first, so the next phase's programs reuse them and the
        step's peak is its largest phase's, not their sum (`release_freed_memory`)."""
        if self.programs.layout.release_memory:
            release_freed_memory()

    def _maybe_reset_reference(self, state: TrainState, step: int) -> TrainState:
        every = self.rl.ref_reset_every
        if not (self.programs.needs_ref and every > 0 and step > 0 and step % every == 0):
            return state
        state = state.replace(ref_params=self.programs.copy(state.params))
        if self.rl.ref_reset_optimizer:
            state = state.replace(opt_state=self.programs.opt_init(state.params))
        return state

    @property
    def keeps_cache(self) -> bool:
        """Whether the sampler keeps each call's KV cache: an episode's later turns go on
        from it."""
        return self.agent is not None and self.agent.keeps_cache

    def sampler_settings(self, step: int) -> SamplerSettings:
        """The step's rollout settings: the run's (`sampler`) at the step's temperature."""
        return dataclasses.replace(self.sampler, temperature=self._temperature(step))

    def _sample(self, state, examples, key, step, timer) -> ro.Rollout:
        """Samples G completions per example and scores them (one sampling round)."""
        g, tok = self.rl.group_size, self.tokenizer
        episodes = environments = toolboxes = row_messages = tools = None
        with timer("sampling"):
            if self.agent is None:
                messages = [ex["messages"] for ex in examples]
            else:
                messages, toolboxes = self.agent.start(examples, g)
                row_messages = [m for m in messages for _ in range(g)]
                tools = self.agent.prompt_tools(examples)
            ids, mask = ro.trim_prompts(*tok.encode_chat(messages, tools=tools), self.buckets)
            sample = self.turn_sampler(state, self.sampler_settings(step), key)
            if toolboxes is None:
                host = sample(ids, mask, g, None, 0)
            else:
                t = self.cfg.sampling.max_new_tokens
                if self.agent.keeps_cache and ids.shape not in self._warm:
                    # Every later-turn shape compiles with the first turn's, not mid-run.
                    self._warm.add(ids.shape)
                    warm_later_turns(
                        sample, ids, mask, group=g, max_new_tokens=t, pad_id=tok.pad_id
                    )
                host, episodes, environments = episode_arrays(
                    self.agent, sample, toolboxes, ids, mask, g, t
                )
            timer.add_tokens(int(host.get("model_mask", host["mask"]).sum()))
        with timer("rewards"):
            completions = tok.batch_decode(host["tokens"], host["mask"])
            tools = tools or [None] * len(messages)
            prompts = [
                tok.apply_chat_template(m, tools=t)
                for m, t in zip(messages, tools, strict=True)
                for _ in range(g)
            ]
            rewards, per_fn, weights, correct = ro.score(
                self.reward_set,
                self.task.name,
                examples,
                prompts,
                completions,
                g,
                step,
                sampled=host,
                max_failed_steps=self.cfg.rewards.max_failed_steps,
                max_steps=self.cfg.steps,
                episodes=episodes,
                environments=environments,
                prompt_messages=row_messages,
            )
        return ro.Rollout(
            examples=examples,
            prompt_ids=ids,
            prompt_mask=mask,
            tokens=host["tokens"],
            mask=host["mask"],
            logprobs=host["logprobs"],
            temps=host["temperatures"],
            stop_reason=host["stop_reason"],
            lengths=host["lengths"],
            prompts=prompts,
            completions=completions,
            rewards=rewards,
            per_fn=per_fn,
            weights=weights,
            correct=correct,
            model_mask=host.get("model_mask"),
            episodes=episodes,
            environments=environments,
        )

    def turn_sampler(self, state: TrainState, settings: SamplerSettings, key) -> Callable:
        """The policy's sampler on the mesh for one step's rollouts (``mesh_sampler``): one
        call per turn of an episode (each keeping its KV cache for the next), or the single
        call of a step without tools."""
        p = self.programs
        return mesh_sampler(
            p.graphdef, (state.params, p.frozen), p.model_cfg, self.mesh, settings, key,
            keep_cache=self.keeps_cache,
        )  # fmt: skip

    def collect(self, state, examples, key, step, draw, timer) -> tuple[ro.Rollout, int]:
        """Sampling rounds; with dynamic sampling, refills zero-variance groups from `draw`."""
        b = self.rl.prompts_per_step
        rounds = [self._sample(state, examples, key, step, timer)]
        if not self.rl.dynamic_sampling:
            return rounds[0], 1
        kept = int((~rounds[0].zero_variance_groups()).sum())
        while kept < b and draw is not None and len(rounds) < self.rl.dynamic_sampling_max_draws:
            more = list(draw(b))
            sub = jax.random.fold_in(key, len(rounds))
            rounds.append(self._sample(state, more, sub, step, timer))
            kept += int((~rounds[-1].zero_variance_groups()).sum())
        merged = ro.concat(rounds, self.tokenizer.pad_id)
        zero = merged.zero_variance_groups()
        # Groups with signal first (in draw order), then zero-variance ones to fill the batch.
        order = np.concatenate([np.flatnonzero(~zero), np.flatnonzero(zero)])[:b]
        return merged.select_groups(np.sort(order)), len(rounds)

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

    def optimize(self, state: TrainState, batch: ro.RolloutBatch, key) -> tuple[TrainState, dict]:
        """ppo_epochs x shuffled minibatches of whole groups, each U micro-batches of M groups
        (U = `micro_batches(batch)`)."""
        b, p = self.rl.prompts_per_step, self.programs
        u = p.micro_batches(batch)
        m = b // (self.rl.num_minibatches * u)
        rng = np.random.default_rng(sharding.to_host(key).astype(np.uint64).tolist())
        history: list[dict] = []
        for _ in range(self.rl.ppo_epochs):
            perm = rng.permutation(b).astype(np.int32)
            for idx_UM in perm.reshape(self.rl.num_minibatches, u, m):
                state, metrics = p.update(state, p.frozen, batch, p.replicate(idx_UM, np.int32))
                history.append(metrics)
        return state, {**step_metrics.reduce_updates(history), "micro_batches": float(u)}

    # ------------------------------------------------------------------------------------------
    # Evaluation.

    def evaluate(self, state: TrainState, examples: Sequence[dict]) -> dict[str, float]:
        """Greedy completions of `examples`: strict/lenient accuracy, reward, length."""
        return held_out.evaluate(self, state, examples)
