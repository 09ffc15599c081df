"""The compiled programs of a training step, apart from the loop that calls them.

``StepPrograms`` splits the model once into the trainable state and the frozen weights, places
both on the mesh, and builds the step's jitted programs with their shardings: the scoring pass
(``make_logprobs_fn``, shared by the reference and old-policy passes), the update
(``make_update_fn``), and the small ones that copy, zero and initialise state. The learner
(``jaxgrpo.rl.learner``) calls them step after step; ``jaxgrpo.planning.aot`` lowers the same
programs with the abstract inputs given here (``abstract_state``, ``abstract_batch``) and
compiles them for a slice that is not here. Neither reaches into the other.

The frozen weights (the base model under LoRA) live here, never in the state: they are passed
to every program and never donated, checkpointed or copied. The reference policy is
``state.ref_params`` with the same frozen weights: zero LoRA (B = 0) at the start, a snapshot of
the policy after a reference reset, or for full fine-tuning with resets a copy of the weights.
Full fine-tuning without resets keeps no copy: its reference is the initial weights held here
anyway (``reference``), one model's worth of memory less.

A teacher (``cfg.teacher``) is a second frozen model on the same mesh, sharded by its own
rules: its weights live here beside the policy's frozen ones, and its scoring pass is the same
prefix-shared, packed program as the reference's, built over its own graph.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.core import sharding
from jaxgrpo.models import packing as packing_lib
from jaxgrpo.models.logprobs import make_logprobs_fn
from jaxgrpo.models.lora import zero_lora
from jaxgrpo.rl import rollout as ro
from jaxgrpo.rl.batch_layout import check_batch_layout
from jaxgrpo.rl.objective import ObjectiveSpec, make_loss_fn, scores_reference
from jaxgrpo.rl.run_log import warn_once
from jaxgrpo.rl.train_state import (
    TrainState,
    make_optimizer,
    make_schedule,
    make_update_fn,
    opt_state_shardings,
)


class StepPrograms:
    """A run's step programs, their shardings and the weights they share.

    Args:
        cfg: the run's `TrainConfig`.
        model: the policy `Transformer` (with LoRA adapters when `cfg.model.lora_rank > 0`),
            its parameters already placed on `mesh`; or an abstract one (`nnx.eval_shape`),
            whose parameters become sharded `jax.ShapeDtypeStruct`s: the programs can then be
            lowered and compiled (`jaxgrpo.planning.aot`), but not run.
        mesh: the (data, fsdp, tensor) mesh.
        teacher: the frozen teacher `Transformer` when `cfg.teacher` uses one (placed, or
            abstract as `model`), else None. Without it the programs and the state have the
            shapes of the run's, so a checkpoint restores, but the step cannot score.

    Attributes:
        graphdef: the model's graph, closed over by every program.
        params0 / frozen: the trainable parameters as built, and the frozen weights.
        objective: the loss's `ObjectiveSpec`.
        needs_ref: the run scores a reference policy (a KL term not aimed at the teacher).
        kl_to_teacher: the KL term's target is the teacher's log-probs.
        teacher_weights: the teacher's (params, rest), or None without a teacher.
        old_from: where behaviour log-probs come from ("none": the loss needs none of the
            batch's, "sampler" or "forward").
        logprobs / teacher_logprobs / update / advance / copy / zero / opt_init: the compiled
            programs.
    """

    def __init__(self, cfg, model, mesh, teacher=None):
        self.cfg, self.rl, self.mesh = cfg, cfg.rl, mesh
        self.model_cfg = model.cfg
        self.lora = bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
        trainable, frozen = (nnx.LoRAParam, nnx.Param) if self.lora else (nnx.Param, ...)
        self.graphdef, params, frozen_state = nnx.split(model, trainable, frozen)
        rules = getattr(getattr(model, "shard_ctx", None), "rules", sharding.TRAIN_RULES)
        self.param_sh = sharding.param_shardings(params, mesh, rules)
        self.frozen_sh = sharding.param_shardings(frozen_state, mesh, rules)
        self.params0 = _place(params, self.param_sh)
        self.n_params = sum(x.size for x in jax.tree.leaves((params, frozen_state)))
        self.n_trainable = sum(x.size for x in jax.tree.leaves(params))
        self.frozen = _place(frozen_state, self.frozen_sh)
        self.replicated = sharding.replicated(mesh)
        self._check_batch_layout()
        self.updates_per_step = self.rl.ppo_epochs * self.rl.num_minibatches
        total = max(1, cfg.steps * self.updates_per_step)
        self.schedule = make_schedule(cfg.optim, total, self.updates_per_step)
        self.layout = self.model_cfg.layout
        self.optimizer = make_optimizer(
            cfg.optim, total, self.updates_per_step, self.layout.grad_norm
        )
        teacher_cfg = cfg.teacher
        if teacher is not None and not teacher_cfg.enabled:
            raise ValueError("a teacher model was given, but cfg.teacher uses none")
        self.kl_to_teacher = scores_reference(self.rl) and teacher_cfg.as_reference
        self.needs_ref = scores_reference(self.rl) and not self.kl_to_teacher
        self._place_teacher(teacher, mesh)
        # Full fine-tuning's reference is the initial weights (`params0`) until a reset.
        self.ref_in_state = self.needs_ref and (self.lora or self.rl.ref_reset_every > 0)
        self.old_from = self._old_logp_source()
        self.objective = ObjectiveSpec.from_config(
            self.rl,
            cfg.sampling,
            use_old_logp=self.old_from != "none",
            distill_coef=teacher_cfg.distill_coef if teacher_cfg.enabled else 0.0,
        )
        self.build()

    def _place_teacher(self, teacher, mesh) -> None:
        """Splits the teacher into (params, rest) on its own rules' shardings."""
        self.teacher_weights = self.teacher_sh = self.teacher_graphdef = None
        self.n_teacher_params = 0
        if teacher is None:
            return
        self.teacher_model_cfg = teacher.cfg
        self.teacher_graphdef, *weights = nnx.split(teacher, nnx.Param, ...)
        rules = getattr(getattr(teacher, "shard_ctx", None), "rules", sharding.TRAIN_RULES)
        self.teacher_sh = tuple(sharding.param_shardings(w, mesh, rules) for w in weights)
        self.teacher_weights = tuple(map(_place, weights, self.teacher_sh))
        self.n_teacher_params = sum(x.size for x in jax.tree.leaves(weights))

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
        """Where behaviour log-probs come from when an update is not on-policy.

        Synchronous, the sampler's are the learner's own in float32 (no forward needed)
        unless TIS weighs the two against each other. Under a lag (`rl.max_staleness >= 1`)
        the sampler's belong to an older policy: "tis" and "mask" weigh against the
        learner's policy at the start of the step, so they need its forward; "clip" takes
        the ratio against the sampler's log-probs, which the loss reads itself.
        """
        if self.updates_per_step == 1:
            return "none"  # on-policy: the loss uses stop_gradient(logp) of its own pass
        if self.rl.max_staleness > 0:
            return "none" if self.rl.lag_correction == "clip" else "forward"
        exact = self.model_cfg.dtype == "float32" and self.rl.tis_cap <= 0
        return "sampler" if exact else "forward"

    def _state_shardings(self) -> TrainState:
        r = self.replicated
        return TrainState(
            params=self.param_sh,
            opt_state=opt_state_shardings(self.optimizer, self.params0, self.param_sh),
            step=r,
            rng=r,
            ref_params=self.param_sh if self.ref_in_state else None,
            skipped=r,
        )

    def build(self) -> None:
        """Builds the programs (again, after a change of ``self.rl``)."""
        self.state_sh = self._state_shardings()
        self.copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.param_sh)
        self.zero = jax.jit(zero_lora, out_shardings=self.param_sh)
        self.opt_init = jax.jit(self.optimizer.init, out_shardings=self.state_sh.opt_state)
        self.logprobs = make_logprobs_fn(self.graphdef, group_size=self.rl.group_size)
        self.teacher_logprobs = None
        if self.teacher_graphdef is not None:
            self.teacher_logprobs = make_logprobs_fn(
                self.teacher_graphdef, group_size=self.rl.group_size
            )
        self.advance = jax.jit(
            lambda step, rng: (step + 1, *jax.random.split(rng, 3)),
            out_shardings=self.replicated,
        )
        self.update = make_update_fn(
            make_loss_fn(self.graphdef, self.objective),
            self.optimizer,
            state_sh=self.state_sh,
            frozen_sh=self.frozen_sh,
            batch_sh=self.batch_shardings(),
            idx_sh=self.replicated,
            accumulating_loss=self.model_cfg.adds_layer_gradients_in_place,
            norm_kernel=self.layout.grad_norm,
        )

    def batch_shardings(self) -> ro.RolloutBatch:
        """Where each field of the update's rollout batch lives: rows over data x fsdp."""
        b = self.rl.prompts_per_step
        n = b * self.rl.group_size
        rows = sharding.batch_sharding(self.mesh, n, 2)
        prompts = sharding.batch_sharding(self.mesh, b, 2)
        packing = None
        if self.rl.pack_completions:
            packing = packing_lib.Packing(
                src_BL=prompts, seg_BL=prompts, pos_BL=prompts, unpack_NT=rows
            )
        return ro.RolloutBatch(
            prompt_ids=prompts,
            prompt_mask=prompts,
            tokens=rows,
            mask=rows,
            loss_mask=rows,
            temps=rows,
            sampler_logp=rows,
            old_logp=rows,
            ref_logp=rows,
            advantages=sharding.batch_sharding(self.mesh, n, 1),
            packing=packing,
            shared_ids=self.replicated,
            teacher_logp=rows if self.objective.use_teacher_logp else None,
        )

    def replicate(self, value, dtype) -> jax.Array:
        """``value`` as a ``dtype`` array replicated over the mesh."""
        x = np.asarray(value, dtype)
        return jax.make_array_from_callback(x.shape, self.replicated, lambda _: x)

    def init_state(self, seed: int) -> TrainState:
        """A fresh state: initial trainable params, optimizer state, step 0, RNG from ``seed``."""
        params = self.copy(self.params0)
        ref = None
        if self.ref_in_state:
            ref = self.zero(params) if self.lora else self.copy(params)
        key = np.asarray(jax.random.key_data(jax.random.key(seed + 1)))
        return TrainState(
            params=params,
            opt_state=self.opt_init(params),
            step=self.replicate(0, np.int32),
            rng=self.replicate(key, np.uint32),
            ref_params=ref,
            skipped=self.replicate(0, np.int32),
        )

    def reference(self, state: TrainState) -> Any:
        """The reference policy's trainable part: the state's, or the initial weights when
        full fine-tuning keeps no copy (no resets)."""
        return state.ref_params if self.ref_in_state else self.params0

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
        if budget < 0:  # auto: the layout's
            budget = self.layout.micro_batch_columns
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

    # ------------------------------------------------------------------------------------------
    # Abstract inputs, for lowering the programs without running them.

    def abstract_state(self) -> TrainState:
        """The state's shapes and shardings (``jax.ShapeDtypeStruct``s)."""
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        abstract = TrainState(
            params=self.params0,
            opt_state=jax.eval_shape(self.optimizer.init, self.params0),
            step=scalar,
            rng=key,
            ref_params=self.params0 if self.ref_in_state else None,
            skipped=scalar,
        )
        return jax.tree.map(abstract_array, abstract, self.state_sh)

    def abstract_batch(self, prompt_len: int, t: int) -> ro.RolloutBatch:
        """The update's rollout batch at its largest: prompts [B, P], completions [N, T]."""
        b, g = self.rl.prompts_per_step, self.rl.group_size
        n = b * g
        host = ro.RolloutBatch(
            prompt_ids=np.zeros((b, prompt_len), np.int32),
            prompt_mask=np.zeros((b, prompt_len), np.int32),
            tokens=np.zeros((n, t), np.int32),
            mask=np.zeros((n, t), np.int32),
            loss_mask=np.zeros((n, t), np.int32),
            temps=np.zeros((n, t), np.float32),
            sampler_logp=np.zeros((n, t), np.float32),
            old_logp=np.zeros((n, t), np.float32),
            ref_logp=np.zeros((n, t), np.float32),
            advantages=np.zeros((n,), np.float32),
            packing=packing_lib.pack(np.full(n, t), g, t) if self.rl.pack_completions else None,
            shared_ids=np.zeros((1, 0), np.int32),
            teacher_logp=np.zeros((n, t), np.float32) if self.objective.use_teacher_logp else None,
        )
        return jax.tree.map(abstract_array, host, self.batch_shardings())


def abstract_array(x, sharding_) -> jax.ShapeDtypeStruct:
    """The shape and dtype of ``x`` (a host array, an array or an abstract one) on
    ``sharding_``."""
    x = x if hasattr(x, "dtype") else np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_)


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
