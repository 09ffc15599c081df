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
public (``collect``, ``prepare``, ``optimize``), so benchmarks time them one by one; the
sampler's side (``collect_batch``) and the learner's (``train``) are apart, so that
``jaxgrpo.rl.pipeline`` can run the first on a thread of its own, ahead of the second.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxgrpo.agents.rollout import warm_later_turns
from jaxgrpo.core import sharding
from jaxgrpo.core.host import release_freed_memory
from jaxgrpo.eval.completions import episode_arrays, mesh_sampler
from jaxgrpo.rl import held_out, step_metrics
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl.batches import BatchPreparer
from jaxgrpo.rl.programs import StepPrograms
from jaxgrpo.rl.sampler_side import SamplerSide
from jaxgrpo.rl.train_state import (
    TrainState,
)
from jaxgrpo.sampling import SamplerSettings, schedules

Draw = Callable[[int], Sequence[dict]]


@dataclasses.dataclass
class Collected:
    """One batch as the sampler's side leaves it for the learner's.

    Attributes:
        rollout: the sampled, scored completions.
        draws: sampling rounds (dynamic sampling refills).
        timer: the sampling and reward phases' seconds; the learner adds its own.
        logged: what reward functions reported with TRL's ``log_metric`` while scoring it.
        step: the training step the batch is for (its temperature, curricula, keys).
        version: the policy version that sampled it (updates applied before its weights).
        sampler_wait_s: how long the sampler waited for that version's weights.
        index: the batch's place in the sampler's sequence (``step`` but where a dropping
            pipeline samples past the run's last step).
    """

    rollout: ro.Rollout
    draws: int
    timer: step_metrics.Timer
    logged: dict[str, list]
    step: int
    version: int = 0
    sampler_wait_s: float = 0.0
    index: int = 0


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
        sampler_mesh: the sampler's own mesh (``mesh.sampler_devices``), or None: rollouts
            are sampled on `mesh`.

    Attributes:
        programs: the step's compiled programs, their shardings and the frozen weights.
        sampler_side: where rollouts are sampled (`jaxgrpo.rl.sampler_side.SamplerSide`).
        sampler: the rollouts' sampler settings (a step samples at its own temperature).
        buckets: the batch widths seen so far (they only grow: few recompiles).
    """

    def __init__(
        self,
        cfg,
        model,
        tokenizer,
        task,
        reward_set,
        mesh=None,
        agent=None,
        teacher=None,
        sampler_mesh=None,
    ):
        self.cfg, self.agent = cfg, agent
        self.tokenizer, self.task, self.reward_set = tokenizer, task, reward_set
        self.mesh = mesh if mesh is not None else sharding.make_mesh({"data": -1})
        self.programs = p = StepPrograms(cfg, model, self.mesh, teacher)
        self.sampler_side = (
            SamplerSide.shared(p)
            if sampler_mesh is None
            else SamplerSide.own(p, sampler_mesh, p.params0)
        )
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
        self.batches = BatchPreparer(cfg, p, self.mesh, self.buckets)
        self._warm: set[tuple[int, ...]] = set()  # prompt shapes whose later turns compiled

    @property
    def rl(self):
        """The run's ``RLConfig``: the programs' (one value for the step, its batches and its
        programs)."""
        return self.programs.rl

    @rl.setter
    def rl(self, value) -> None:
        self.programs.rl = value

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
        self._end_phase()
        batch = self.collect_batch(state.params, list(examples), k_sample, step, draw, step)
        return self.train(state, batch, (next_step, next_rng, k_shuffle), t_start)

    def collect_batch(
        self, params, examples, key, step: int, draw: Draw | None = None, version: int = 0
    ) -> Collected:
        """The sampler's side of a step: `collect` with the policy's trainable `params` (the
        learner's own, or a copy of version `version` on the sampler's devices), and what the
        reward functions logged while scoring it."""
        timer = step_metrics.Timer()
        with self.reward_set.lock:  # an evaluation on another thread scores after, not beside
            self.reward_set.forget_logged()
            rollout, draws = self.collect(params, examples, key, step, draw, timer)
            logged = {name: list(v) for name, v in self.reward_set.logged_metrics.items()}
        drawn = rollout.trained_mask > 0
        rollout = dataclasses.replace(
            rollout, versions=np.where(drawn, version, -1).astype(np.int32)
        )
        return Collected(rollout, draws, timer, logged, step, version, index=step)

    def train(
        self, state: TrainState, batch: Collected, advanced: tuple, t_start: float | None = None
    ) -> tuple[TrainState, dict[str, float], list[dict]]:
        """The learner's side of a step: scoring passes, advantages and the updates on
        `batch`, then the state's step and key advanced to `advanced` = (next step, next
        key, the update's shuffle key) from `programs.advance`."""
        t_start = time.perf_counter() if t_start is None else t_start
        next_step, next_rng, k_shuffle = advanced
        step = int(sharding.to_host(state.step))
        rollout, timer = batch.rollout, batch.timer
        self._end_phase()
        prepared, extra = self.prepare(state, rollout, timer)
        self._end_phase()
        with timer("update"):
            state, update_metrics = self.optimize(state, prepared, k_shuffle)
        state = state.replace(step=next_step, rng=next_rng)
        metrics = step_metrics.step_metrics(rollout, extra, update_metrics, timer.seconds)
        # What reward functions reported with TRL's log_metric (a reward model's time): means.
        metrics.update({name: float(np.mean(v)) for name, v in batch.logged.items() if v})
        metrics.update(
            draws=float(batch.draws),
            lr=float(self.programs.schedule(step * self.programs.updates_per_step)),
            temperature=self.step_temperature(batch.step),
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

    def _sample(self, params, examples, key, step, timer) -> ro.Rollout:
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
            sample = self.turn_sampler(params, self.sampler_settings(step), key)
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

    def turn_sampler(self, params, settings: SamplerSettings, key) -> Callable:
        """The policy's sampler with trainable `params` for one step's rollouts
        (``mesh_sampler``), on the sampler's devices (``sampler_side``): one call per turn of
        an episode (each keeping its KV cache for the next), or the single call of a step
        without tools."""
        side = self.sampler_side
        if side.own_devices:  # the step's key is the learner's: replicated on its devices
            key = jax.device_put(key, sharding.replicated(side.mesh))
        return mesh_sampler(
            side.graphdef, (params, side.frozen), self.programs.model_cfg, side.mesh, settings,
            key, keep_cache=self.keeps_cache,
        )  # fmt: skip

    def collect(self, params, examples, key, step, draw, timer) -> tuple[ro.Rollout, int]:
        """Sampling rounds with trainable `params`; with dynamic sampling, refills
        zero-variance groups from `draw`."""
        b = self.rl.prompts_per_step
        rounds = [self._sample(params, examples, key, step, timer)]
        if not self.rl.dynamic_sampling:
            return rounds[0], 1
        kept = int((~rounds[0].zero_variance_groups()).sum())
        while kept < b and draw is not None and len(rounds) < self.rl.dynamic_sampling_max_draws:
            more = list(draw(b))
            sub = jax.random.fold_in(key, len(rounds))
            rounds.append(self._sample(params, more, sub, step, timer))
            kept += int((~rounds[-1].zero_variance_groups()).sum())
        merged = ro.concat(rounds, self.tokenizer.pad_id)
        zero = merged.zero_variance_groups()
        # Groups with signal first (in draw order), then zero-variance ones to fill the batch.
        order = np.concatenate([np.flatnonzero(~zero), np.flatnonzero(zero)])[:b]
        return merged.select_groups(np.sort(order)), len(rounds)

    def prepare(
        self, state: TrainState, r: ro.Rollout, timer: step_metrics.Timer | None = None
    ) -> tuple[ro.RolloutBatch, dict]:
        """The update's device batch of rollout `r` (`BatchPreparer.prepare`)."""
        return self.batches.prepare(state, r, timer)

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
