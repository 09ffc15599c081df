"""One GRPO training step, as a readable loop over compiled programs.

    examples --chat template--> prompts [B, P] --sampler (prefill + decode)--> completions [R, T]
      --decode + rewards (host)--> rewards [R] --(dynamic sampling: refill zero-variance groups)
      --reference log-probs (LoRA zeroed, prefix-shared; skipped when beta == 0)
      --KL in reward (optional)--> group advantages [R]
      --ppo_epochs x shuffled minibatches of groups x grad-accum micro-batches--> optax updates

The compiled programs are the sampler's prefill and decode, the prefix-shared scoring pass
(`make_logprobs_fn`, shared by the reference and old-policy passes) and the update
(`make_update_fn`); each compiles once per shape bucket, so a second step with the same
buckets compiles nothing.

The frozen weights (the base model under LoRA) live in the `Learner`, never in the state: they
are passed to every program and never donated, checkpointed or copied. The reference policy is
`state.ref_params` with the same frozen weights: zero LoRA (B = 0) at the start, a snapshot of
the policy after a reference reset, or for full fine-tuning with resets a copy of the weights.
Full fine-tuning without resets keeps no copy: its reference is the initial weights the learner
holds anyway (`Learner.reference`), one model's worth of memory less.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.core import sharding
from jaxgrpo.core.host import release_freed_memory
from jaxgrpo.models import packing as packing_lib
from jaxgrpo.models.logprobs import make_logprobs_fn
from jaxgrpo.models.lora import zero_lora
from jaxgrpo.rl import held_out, step_metrics
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl.batch_layout import check_batch_layout
from jaxgrpo.rl.kl import kl_penalized_rewards
from jaxgrpo.rl.objective import ObjectiveSpec, make_loss_fn
from jaxgrpo.rl.run_log import warn_once
from jaxgrpo.rl.train_state import (
    TrainState,
    make_optimizer,
    make_schedule,
    make_update_fn,
    opt_state_shardings,
)
from jaxgrpo.sampling import generate_from_state, schedules

Draw = Callable[[int], Sequence[dict]]

# `rl.micro_batch_columns = -1` on CPU hosts: token columns one micro-batch of the update scores
# per device before the minibatch splits further (benchmarks/README.md, "Session 16": the
# 512-token gsm8k update in 4 micro-batches of one packed row ran faster than in one of four).
AUTO_MICRO_BATCH_COLUMNS = 4096


class Learner:
    """Owns the compiled programs of a run and applies one training step at a time.

    Args:
        cfg: the run's `TrainConfig`.
        model: the policy `Transformer` (with LoRA adapters when `cfg.model.lora_rank > 0`),
            its parameters already placed on `mesh`; or an abstract one (`nnx.eval_shape`),
            whose parameters become sharded `jax.ShapeDtypeStruct`s: the programs are then
            built as for a run and can be lowered and compiled (`jaxgrpo.planning.compile`),
            but not run.
        tokenizer: `jaxgrpo.models.tokenizer.Tokenizer` with a chat template.
        task: the task (its name selects the accuracy rule).
        reward_set: `jaxgrpo.rewards.RewardSet`.
        mesh: the (data, fsdp, tensor) mesh; None makes one over all devices on `data`.
    """

    def __init__(self, cfg, model, tokenizer, task, reward_set, mesh=None):
        self.cfg, self.rl = cfg, cfg.rl
        self.tokenizer, self.task, self.reward_set = tokenizer, task, reward_set
        self.mesh = mesh if mesh is not None else sharding.make_mesh({"data": -1})
        self.model_cfg = model.cfg
        self.lora = bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
        trainable, frozen = (nnx.LoRAParam, nnx.Param) if self.lora else (nnx.Param, ...)
        self.graphdef, params, frozen_state = nnx.split(model, trainable, frozen)
        rules = getattr(getattr(model, "shard_ctx", None), "rules", sharding.TRAIN_RULES)
        self.param_sh = sharding.param_shardings(params, self.mesh, rules)
        self.frozen_sh = sharding.param_shardings(frozen_state, self.mesh, rules)
        self._params0 = _place(params, self.param_sh)
        self.n_params = sum(x.size for x in jax.tree.leaves((params, frozen_state)))
        self.n_trainable = sum(x.size for x in jax.tree.leaves(params))
        self.frozen = _place(frozen_state, self.frozen_sh)
        self.replicated = sharding.replicated(self.mesh)
        self._check_batch_layout()
        self.updates_per_step = self.rl.ppo_epochs * self.rl.num_minibatches
        total = max(1, cfg.steps * self.updates_per_step)
        self.schedule = make_schedule(cfg.optim, total, self.updates_per_step)
        self.optimizer = make_optimizer(cfg.optim, total, self.updates_per_step)
        self.needs_ref = self.rl.beta > 0
        # Full fine-tuning's reference is the initial weights (`_params0`) until a reset.
        self.ref_in_state = self.needs_ref and (self.lora or self.rl.ref_reset_every > 0)
        self.old_from = self._old_logp_source()
        self.objective = ObjectiveSpec(
            group_size=self.rl.group_size,
            loss_type=self.rl.loss_type,
            eps_low=self.rl.eps_low,
            eps_high=self.rl.eps_high,
            beta=0.0 if self.rl.kl_in_reward else self.rl.beta,
            kl_estimator=self.rl.kl_estimator,
            kl_bias_correction=self.rl.kl_bias_correction,
            ratio_cap=self.rl.ratio_cap or None,
            dual_clip=self.rl.dual_clip or None,
            top_entropy_frac=self.rl.top_entropy_frac or None,
            entropy_coef=self.rl.entropy_coef,
            tis_cap=self.rl.tis_cap,
            use_old_logp=self.old_from != "none",
            use_ref_logp=self.needs_ref and not self.rl.kl_in_reward,
            max_completion_length=cfg.sampling.max_new_tokens,
        )
        self._temperature = self._make_temperature()
        self.buckets = ro.ShapeBuckets()  # batch widths that only grow: few recompiles
        self._build_programs()

    # ------------------------------------------------------------------------------------------
    # Set-up.

    def _check_batch_layout(self) -> None:
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        check_batch_layout(self.rl, shards)
        rows = self.rl.prompts_per_step // (self.rl.num_minibatches * self.rl.grad_accum)
        if self.rl.pack_completions and rows % shards:
            warn_once(
                "packed-rows",
                f"a micro-batch packs its completions into {rows} rows (one per prompt), which "
                f"do not split over data * fsdp = {shards} devices: every device scores all of "
                "them. Lower rl.grad_accum / rl.num_minibatches so that prompts_per_step / "
                "(num_minibatches * grad_accum) is a multiple of it, or set "
                "rl.pack_completions=False.",
            )

    def _old_logp_source(self) -> str:
        """Where behaviour log-probs come from when an update is not on-policy."""
        if self.updates_per_step == 1:
            return "none"  # on-policy: the loss uses stop_gradient(logp) of its own pass
        exact = self.model_cfg.dtype == "float32" and self.rl.tis_cap <= 0
        return "sampler" if exact else "forward"

    def _make_temperature(self) -> Callable[[int], float | np.ndarray]:
        """Step -> the rollout's temperature: a float, or float32 [T] with a position schedule."""
        sp = self.cfg.sampling
        s, p, t = sp.temperature_schedule, sp.position_schedule, sp.max_new_tokens
        per_step = schedules.build(
            s.kind, init=sp.temperature, end=s.end, steps=s.steps or self.cfg.steps,
            boundaries=s.boundaries, values=s.levels,
        )  # fmt: skip
        self.step_temperature = lambda step: float(per_step(step))
        if p.kind == "constant":
            return self.step_temperature
        per_position = schedules.build(
            p.kind, init=1.0, end=p.end, steps=p.steps or t, boundaries=p.boundaries,
            values=p.levels,
        )  # fmt: skip
        return lambda step: np.asarray(schedules.temperatures(step, t, per_step, per_position))

    def _state_shardings(self) -> TrainState:
        r = self.replicated
        return TrainState(
            params=self.param_sh,
            opt_state=opt_state_shardings(self.optimizer, self._params0, self.param_sh),
            step=r,
            rng=r,
            ref_params=self.param_sh if self.ref_in_state else None,
            skipped=r,
        )

    def _build_programs(self) -> None:
        self.state_sh = self._state_shardings()
        self._copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.param_sh)
        self._zero = jax.jit(zero_lora, out_shardings=self.param_sh)
        self._opt_init = jax.jit(self.optimizer.init, out_shardings=self.state_sh.opt_state)
        self._logprobs = make_logprobs_fn(self.graphdef, group_size=self.rl.group_size)
        self._advance = jax.jit(
            lambda step, rng: (step + 1, *jax.random.split(rng, 3)),
            out_shardings=self.replicated,
        )
        batch_sh = self._batch_shardings()
        self._update = make_update_fn(
            make_loss_fn(self.graphdef, self.objective),
            self.optimizer,
            state_sh=self.state_sh,
            frozen_sh=self.frozen_sh,
            batch_sh=batch_sh,
            idx_sh=self.replicated,
            accumulating_loss=self.model_cfg.adds_layer_gradients_in_place,
        )

    def _batch_shardings(self) -> ro.RolloutBatch:
        b = self.rl.prompts_per_step
        n = b * self.rl.group_size
        rows = sharding.batch_sharding(self.mesh, n, 2)
        return ro.RolloutBatch(
            prompt_ids=sharding.batch_sharding(self.mesh, b, 2),
            prompt_mask=sharding.batch_sharding(self.mesh, b, 2),
            tokens=rows,
            mask=rows,
            temps=rows,
            sampler_logp=rows,
            old_logp=rows,
            ref_logp=rows,
            advantages=sharding.batch_sharding(self.mesh, n, 1),
            packing=packing_lib.Packing(
                src_BL=sharding.batch_sharding(self.mesh, b, 2),
                seg_BL=sharding.batch_sharding(self.mesh, b, 2),
                pos_BL=sharding.batch_sharding(self.mesh, b, 2),
                unpack_NT=rows,
            )
            if self.rl.pack_completions
            else None,
            shared_ids=self.replicated,
        )

    def _replicate(self, value, dtype) -> jax.Array:
        x = np.asarray(value, dtype)
        return jax.make_array_from_callback(x.shape, self.replicated, lambda _: x)

    def init_state(self) -> TrainState:
        """A fresh state: initial trainable params, optimizer state, step 0, seeded RNG."""
        params = self._copy(self._params0)
        ref = None
        if self.ref_in_state:
            ref = self._zero(params) if self.lora else self._copy(params)
        key = np.asarray(jax.random.key_data(jax.random.key(self.cfg.seed + 1)))
        return TrainState(
            params=params,
            opt_state=self._opt_init(params),
            step=self._replicate(0, np.int32),
            rng=self._replicate(key, np.uint32),
            ref_params=ref,
            skipped=self._replicate(0, np.int32),
        )

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
        next_step, next_rng, k_sample, k_shuffle = self._advance(state.step, state.rng)
        timer = step_metrics.Timer()
        # Each phase's programs reuse the heap the last one freed, whose pages go back first:
        # the step's peak is its largest phase's, not their sum (`release_freed_memory`).
        release_freed_memory()
        rollout, draws = self._collect(state, list(examples), k_sample, step, draw, timer)
        release_freed_memory()
        batch, extra = self._prepare(state, rollout, timer)
        release_freed_memory()
        with timer("update"):
            state, update_metrics = self._optimize(state, batch, k_shuffle)
        state = state.replace(step=next_step, rng=next_rng)
        metrics = step_metrics.step_metrics(rollout, extra, update_metrics, timer.seconds)
        metrics.update(
            draws=float(draws),
            lr=float(self.schedule(step * self.updates_per_step)),
            temperature=self.step_temperature(step),
            skipped_updates=float(sharding.to_host(state.skipped)),
        )
        metrics["time/step_learner"] = time.perf_counter() - t_start
        fwd = int(self.needs_ref) + int(self.old_from == "forward")
        metrics.update(
            step_metrics.flop_metrics(
                self.n_params, rollout, fwd, self.updates_per_step, metrics["time/step_learner"]
            )
        )
        return state, metrics, step_metrics.samples(rollout, extra["advantages"], step)

    def _maybe_reset_reference(self, state: TrainState, step: int) -> TrainState:
        every = self.rl.ref_reset_every
        if not (self.needs_ref and every > 0 and step > 0 and step % every == 0):
            return state
        state = state.replace(ref_params=self._copy(state.params))
        if self.rl.ref_reset_optimizer:
            state = state.replace(opt_state=self._opt_init(state.params))
        return state

    def reference(self, state: TrainState) -> Any:
        """The reference policy's trainable part: the state's, or the initial weights when
        full fine-tuning keeps no copy (no resets)."""
        return state.ref_params if self.ref_in_state else self._params0

    def sampler_kwargs(self, step: int) -> dict[str, Any]:
        """The keyword arguments of the step's `generate_from_state` call (rollouts)."""
        sp, tok = self.cfg.sampling, self.tokenizer
        return dict(
            max_new_tokens=sp.max_new_tokens,
            temperature=self._temperature(step),
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            eos_ids=tok.eos_ids,
            num_samples=self.rl.group_size,
            repetition_ngram=sp.repetition_guard[0],
            repetition_count=max(sp.repetition_guard[1], 1),
            pad_id=tok.pad_id,
        )

    def _sample(self, state, examples, key, step, timer) -> ro.Rollout:
        """Samples G completions per example and scores them (one sampling round)."""
        g, tok = self.rl.group_size, self.tokenizer
        with timer("sampling"):
            messages = [ex["messages"] for ex in examples]
            ids, mask = ro.trim_prompts(*tok.encode_chat(messages), self.buckets)
            out = generate_from_state(
                self.graphdef,
                (state.params, self.frozen),
                self.model_cfg,
                sharding.put_batch(ids, self.mesh),
                sharding.put_batch(mask, self.mesh),
                rng=key,
                **self.sampler_kwargs(step),
            )
            host = {k: sharding.to_host(getattr(out, k)) for k in step_metrics.SAMPLE_FIELDS}
            timer.add_tokens(int(host["lengths"].sum()))
        with timer("rewards"):
            completions = tok.batch_decode(host["tokens"], host["mask"])
            prompts = [tok.apply_chat_template(m) for m in messages for _ in range(g)]
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
        )

    def _collect(self, state, examples, key, step, draw, timer) -> tuple[ro.Rollout, int]:
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

    def _prepare(
        self, state: TrainState, r: ro.Rollout, timer: step_metrics.Timer | None = None
    ) -> tuple[ro.RolloutBatch, dict]:
        """Reference/old log-probs, KL-in-reward, advantages, loss mask -> the device batch.

        The scoring passes count as the "reference" phase of ``timer``, the rest as "update"."""
        timer = timer or step_metrics.Timer()
        with timer("update"):
            inputs, packing, shared, t = self._batch_inputs(r)
        with timer("reference"):
            logps = self._scoring_passes(state, r, inputs, packing, shared, t)
        with timer("update"):
            return self._finish_batch(r, inputs, packing, shared, t, *logps)

    def _batch_inputs(self, r: ro.Rollout) -> tuple:
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
        shared = self._replicate(shared, np.int32)
        inputs = (put(prompt_ids), put(prompt_mask), put(tokens), put(mask), put(temps))
        return inputs, packing, shared, t

    def _scoring_passes(self, state: TrainState, r: ro.Rollout, inputs, packing, shared, t):
        """(sampler, old-policy, reference) log-probs [R, T], waited for, so that the phase
        timer counts their compute and not only their dispatch."""
        put = lambda x: sharding.put_batch(x, self.mesh)  # noqa: E731
        sampler_logp = put(r.logprobs[:, :t].astype(np.float32))
        ref_logp = old_logp = put(np.zeros(inputs[2].shape, np.float32))
        if self.needs_ref:
            ref = self.reference(state)
            ref_logp = self._logprobs(ref, self.frozen, *inputs, packing, shared)[0]
        if self.old_from == "forward":
            old_logp = self._logprobs(state.params, self.frozen, *inputs, packing, shared)[0]
        elif self.old_from == "sampler":
            old_logp = sampler_logp
        return jax.block_until_ready((sampler_logp, old_logp, ref_logp))

    def _finish_batch(self, r, inputs, packing, shared, t, sampler_logp, old_logp, ref_logp):
        """KL-in-reward, advantages and the loss mask -> (the device batch, host extras)."""
        put = lambda x: sharding.put_batch(x, self.mesh)  # noqa: E731
        mask = r.mask[:, :t]
        truncated = r.stop_reason == step_metrics.LENGTH
        loss_mask = r.mask * (~truncated[:, None]) if self.rl.mask_truncated else r.mask
        loss_mask = loss_mask[:, :t]
        rewards = r.rewards
        extra: dict[str, Any] = {}
        if self.needs_ref and self.rl.kl_in_reward:
            behaviour = (
                sharding.to_host(old_logp) if self.old_from == "forward" else r.logprobs[:, :t]
            )
            penalized, kl_R = kl_penalized_rewards(
                rewards, behaviour, sharding.to_host(ref_logp), mask, self.rl.beta
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
            mask=put(loss_mask.astype(np.int32)),
            temps=inputs[4],
            sampler_logp=sampler_logp,
            old_logp=old_logp,
            ref_logp=ref_logp,
            advantages=put(adv.astype(np.float32)),
            packing=packing,
            shared_ids=shared,
        )
        return batch, extra

    def micro_batches(self, batch: ro.RolloutBatch) -> int:
        """Micro-batches per optimizer update of `batch` (arrays or their abstract shapes).

        `rl.grad_accum`, or the fewest more (a divisor of the minibatch's prompts, keeping each
        micro-batch's sequences, and packed rows where they did, split over data x fsdp) whose
        micro-batch scores at most `rl.micro_batch_columns` columns per device: activation
        memory then stops growing with the completions' length. The gradient is the same
        (every micro-batch is normalised by the whole minibatch); only the program differs.
        """
        rl = self.rl
        budget = rl.micro_batch_columns
        if budget < 0:
            cpu = self.mesh.devices.flat[0].platform == "cpu"
            budget = AUTO_MICRO_BATCH_COLUMNS if cpu else 0
        if budget == 0:
            return rl.grad_accum
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        prompts = rl.prompts_per_step // rl.num_minibatches
        # A row: the prompt, then its group's packed completions (or one completion).
        width = batch.prompt_ids.shape[1] + (
            batch.packing.src_BL.shape[1] if batch.packing is not None else batch.tokens.shape[1]
        )

        def rows(u: int) -> int:  # rows of one micro-batch
            return prompts // u if rl.pack_completions else prompts // u * rl.group_size

        split_rows = rows(rl.grad_accum) % shards == 0  # the configured count splits its rows

        def fits(u: int) -> bool:  # splits over the devices as the configured count did
            sequences = prompts // u * rl.group_size
            return sequences % shards == 0 and (not split_rows or rows(u) % shards == 0)

        counts = [u for u in range(rl.grad_accum, prompts + 1) if prompts % u == 0 and fits(u)]
        for u in counts:
            r = rows(u)
            if (r // shards if r % shards == 0 else r) * width <= budget:
                return u
        return counts[-1]

    def _optimize(self, state: TrainState, batch: ro.RolloutBatch, key) -> tuple[TrainState, dict]:
        """ppo_epochs x shuffled minibatches of whole groups, each U micro-batches of M groups
        (U = `micro_batches(batch)`)."""
        b = self.rl.prompts_per_step
        u = self.micro_batches(batch)
        m = b // (self.rl.num_minibatches * u)
        rng = np.random.default_rng(sharding.to_host(key).astype(np.uint64).tolist())
        history: list[dict] = []
        for _ in range(self.rl.ppo_epochs):
            perm = rng.permutation(b).astype(np.int32)
            for idx_UM in perm.reshape(self.rl.num_minibatches, u, m):
                state, metrics = self._update(
                    state, self.frozen, batch, self._replicate(idx_UM, np.int32)
                )
                history.append(metrics)
        return state, {**step_metrics.reduce_updates(history), "micro_batches": float(u)}

    # ------------------------------------------------------------------------------------------
    # Evaluation.

    def evaluate(self, state: TrainState, examples: Sequence[dict]) -> dict[str, float]:
        """Greedy completions of `examples`: strict/lenient accuracy, reward, length."""
        return held_out.evaluate(self, state, examples)


def _place(tree, shardings):
    """Puts `tree` on `shardings`, leaving leaves that are already there untouched; abstract
    leaves become `jax.ShapeDtypeStruct`s carrying their sharding."""

    def put(x, s):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
            return x
        return jax.device_put(x, s)

    return jax.tree.map(put, tree, shardings)
