"""The differentiable micro-batch loss of the update: scoring + `policy_loss` + global normaliser.

One optimizer update trains on a minibatch of whole groups (a group's G completions share their
prompt, so prefix sharing needs them together), split into A micro-batches of M groups whose
gradients are summed. The loss of each micro-batch is normalised by the token and sequence
counts of the whole minibatch (`loss_normalizers`), so the summed gradient is exactly the
minibatch gradient for every loss type (see `jaxgrpo.rl.losses`).

Behaviour log-probs: on-policy (one update per rollout) the ratio is taken against
`stop_gradient(logp)` of this very pass, so no extra forward is needed; otherwise the rollout
carries `old_logp`. The sampler's own log-probs give the sampler-versus-trainer gap metric and,
with `tis_cap > 0`, truncated importance weights `min(exp(behaviour - sampler), cap)`.

Lag correction (`lag_correction`, with `rl.max_staleness >= 1`): the batch may come from a
policy a few optimizer steps older than the learner's, and `sampler_logp` holds that stale
policy's log-probs. With `r = exp(proximal - sampler)` per token (proximal: the behaviour above,
the learner's policy at the start of the step), "tis" (decoupled PPO, AReaL) keeps the clip
against the proximal policy and weighs the policy term by `min(r, lag_cap)`; "mask" (IcePop,
prime-rl) weighs it by `r` inside `[lag_floor, lag_cap]` and drops the tokens outside; "clip"
takes PPO's ratio against the stale policy itself, so its clip bounds how far the update moves
from what sampled. "clip" is the default: with one update per step the proximal policy is the
learner's own, so "tis"'s clip never bites and its truncated weight is all that bounds the
update, which did not hold at a lag of 2 on format_copy (benchmarks/README.md, "Asynchronous
rollouts"); "tis" is for runs with several updates per step, where the clip does bite. The
weights touch only the policy term, never the KL or entropy terms. A synchronous run
(`"none"`) traces exactly the program it traced before the option existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.core.shapes import Array, PyTree
from jaxgrpo.models.accumulate import add_into_gradient
from jaxgrpo.models.logprobs import shared_prefix_logprobs
from jaxgrpo.rl.loss_spec import LAG_CORRECTIONS, Objective
from jaxgrpo.rl.losses import (
    loss_normalizers,
    masked_is_weights,
    policy_loss,
    truncated_is_weights,
)
from jaxgrpo.rl.rollout import RolloutBatch


def scores_reference(rl) -> bool:
    """Whether a run keeps and scores a reference policy: ``beta > 0`` in its ``RLConfig``
    (``rl``), the KL going into the loss or, with ``kl_in_reward``, into the rewards."""
    return rl.beta > 0


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """Static choices of the update's loss (hashable; closed over by the compiled update).

    Attributes:
        loss: what `policy_loss` optimises, passed to it whole.
        group_size: G.
        tis_cap: truncated importance-sampling cap; 0 = off.
        use_old_logp: take behaviour log-probs from the batch (several updates per rollout).
        use_ref_logp: add the KL term against the batch's reference log-probs (a teacher's,
            with ``teacher.as_reference``).
        use_teacher_logp: add the distillation term from the batch's teacher log-probs.
        chunk_size: positions per logits block.
        lag_correction: how the loss corrects for a batch sampled by an older policy: "none"
            (a synchronous run) or one of `LAG_CORRECTIONS` (module docstring).
        lag_cap: "tis"'s truncation of the weight and "mask"'s upper edge.
        lag_floor: "mask"'s lower edge.
    """

    loss: Objective
    group_size: int
    tis_cap: float
    use_old_logp: bool
    use_ref_logp: bool
    use_teacher_logp: bool = False
    chunk_size: int = 64
    lag_correction: str = "none"
    lag_cap: float = 2.0
    lag_floor: float = 0.5

    @classmethod
    def from_config(cls, rl, sampling, *, use_old_logp: bool, distill_coef: float = 0.0):
        """The loss of a run: its ``RLConfig`` (``rl``, where 0 turns an option off) and the
        sampler's ``max_new_tokens`` (Dr. GRPO's constant: the batch itself may be trimmed to
        its longest completion); ``use_old_logp`` is the learner's choice (several updates
        per rollout); ``distill_coef`` the teacher's (``teacher.distill_coef``, 0 = none).
        The lag correction is ``rl.lag_correction`` when batches may be stale
        (``rl.max_staleness >= 1``), else "none"."""
        kl_in_loss = scores_reference(rl) and not rl.kl_in_reward
        loss = Objective.preset(
            rl.loss_type,
            eps_low=rl.eps_low,
            eps_high=rl.eps_high,
            beta=0.0 if rl.kl_in_reward else rl.beta,
            kl_estimator=rl.kl_estimator,
            kl_bias_correction=rl.kl_bias_correction,
            max_completion_length=sampling.max_new_tokens,
            dual_clip=rl.dual_clip or None,
            ratio_cap=rl.ratio_cap or None,
            entropy_coef=rl.entropy_coef,
            top_entropy_frac=rl.top_entropy_frac or None,
            distill_coef=distill_coef,
        )
        return cls(
            loss=loss,
            group_size=rl.group_size,
            tis_cap=rl.tis_cap,
            use_old_logp=use_old_logp,
            use_ref_logp=kl_in_loss,
            use_teacher_logp=distill_coef > 0,
            lag_correction=rl.lag_correction if rl.max_staleness > 0 else "none",
            lag_cap=rl.lag_cap,
            lag_floor=rl.lag_floor,
        )


def group_rows(idx_M: Array, group_size: int) -> Array:
    """Row indices [M * G] of the completions of groups `idx_M` [M]."""
    return (idx_M[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)


def _masked_mean(x_RT: Array, mask_RT: Array) -> Array:
    m = mask_RT.astype(jnp.float32)
    return jnp.sum(x_RT * m) / jnp.maximum(jnp.sum(m), 1.0)


def lag_correction(
    mode: str,
    proximal_RT: Array,
    sampler_RT: Array,
    mask_RT: Array,
    *,
    cap,
    floor,
    eps_low,
    eps_high,
) -> tuple[Array | None, Array | None, dict[str, Array]]:
    """The loss's correction for a batch sampled by an older policy (module docstring).

    Args:
        mode: "tis", "mask" or "clip" (static).
        proximal_RT: [R, T] the learner's log-probs at the start of the step: the behaviour
            the loss already uses (`stop_gradient(logp)` on-policy, else `old_logp`).
        sampler_RT: [R, T] the log-probs the sampler (the stale policy) reported.
        mask_RT: [R, T] the tokens trained on; other entries may hold garbage.
        cap: `lag_cap`; floor: `lag_floor` (both may be traced).
        eps_low, eps_high: the objective's clip range, for "clip"'s clipped fraction.

    Returns:
        `(old_logp, is_weights, metrics)`: the log-probs the loss's ratio is taken against
        (`sampler_RT` for "clip", else None: the loss's own behaviour), the [R, T] weights of
        the policy term (None for "clip"), and over `mask_RT`'s tokens, with `w` the weights
        (for "clip", `r`): `lag/is_weight_mean`, `lag/is_weight_max`, `lag/is_clipped_frac`
        (tokens truncated, masked or outside the clip range) and `lag/ess`, the normalised
        effective sample size `(sum w)^2 / (n * sum w^2)` (0 when every weight is 0).
    """
    if mode not in LAG_CORRECTIONS:
        raise ValueError(f"lag_correction must be one of {LAG_CORRECTIONS}, got {mode!r}")
    valid_RT = mask_RT.astype(bool)
    dtype = jnp.promote_types(proximal_RT.dtype, jnp.float32)

    def clean(x):  # garbage outside the mask must not overflow into the metrics
        return jnp.where(valid_RT, jax.lax.stop_gradient(x).astype(dtype), jnp.zeros((), dtype))

    proximal_RT, sampler_RT = clean(proximal_RT), clean(sampler_RT)
    ratio_RT = jnp.exp(proximal_RT - sampler_RT)
    old_logp, is_weights = None, None
    if mode == "tis":
        is_weights = w_RT = truncated_is_weights(proximal_RT, sampler_RT, cap)
        out_RT = ratio_RT > cap
    elif mode == "mask":
        is_weights = w_RT = masked_is_weights(proximal_RT, sampler_RT, floor, cap)
        out_RT = (ratio_RT < floor) | (ratio_RT > cap)
    else:
        old_logp, w_RT = sampler_RT, ratio_RT
        out_RT = (ratio_RT < 1.0 - eps_low) | (ratio_RT > 1.0 + eps_high)
    w_RT = jnp.where(valid_RT, w_RT, jnp.zeros((), dtype))
    n = jnp.sum(valid_RT).astype(dtype)
    sum_w, sum_w2 = jnp.sum(w_RT), jnp.sum(w_RT * w_RT)
    some = n * sum_w2 > 0
    metrics = {
        "lag/is_weight_mean": sum_w / jnp.maximum(n, 1.0),
        "lag/is_weight_max": jnp.max(w_RT),
        "lag/is_clipped_frac": jnp.sum(out_RT & valid_RT).astype(dtype) / jnp.maximum(n, 1.0),
        "lag/ess": jnp.where(some, sum_w * sum_w / jnp.where(some, n * sum_w2, 1.0), 0.0),
    }
    return old_logp, is_weights, metrics


def _behaviour(spec: ObjectiveSpec, logp, old_logp, sampler_logp, mask):
    """(the `old_logp` passed to `policy_loss`, its `is_weights`, the lag metrics): the
    sampler/trainer weights (`tis_cap`) of a synchronous run, or its lag correction."""
    proximal = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    if spec.lag_correction != "none":
        eps = dict(eps_low=spec.loss.eps_low, eps_high=spec.loss.eps_high)
        against, is_weights, metrics = lag_correction(
            spec.lag_correction, proximal, sampler_logp, mask,
            cap=spec.lag_cap, floor=spec.lag_floor, **eps,
        )  # fmt: skip
        return (old_logp if against is None else against), is_weights, metrics
    is_weights = None
    if spec.tis_cap > 0:
        is_weights = truncated_is_weights(proximal, sampler_logp, spec.tis_cap)
    return old_logp, is_weights, {}


def fold_accumulator(params: nnx.State, frozen: nnx.State, grad_acc: nnx.State | None):
    """(`params`, the layers' accumulator): `params` whose gradient comes out with `grad_acc`
    added. When every layer weight is trainable (full fine-tuning), the stacked layers'
    share is added inside the layer scan's backward loop, in place
    (`Transformer.forward_segments`), and returned for it; otherwise every leaf is folded
    here (`add_into_gradient`) and the layers' share is None."""
    if grad_acc is None:
        return params, None
    if "layers" not in params or ("layers" in frozen and jax.tree.leaves(frozen["layers"])):
        return add_into_gradient(params, grad_acc), None
    rest = {k: v for k, v in params.items() if k != "layers"}
    folded = add_into_gradient(rest, {k: grad_acc[k] for k in rest})
    return nnx.State({**folded, "layers": params["layers"]}), grad_acc["layers"]


def make_loss_fn(
    graphdef: nnx.GraphDef, spec: ObjectiveSpec
) -> Callable[[PyTree, PyTree, RolloutBatch, Array, Array], tuple[Array, dict[str, Array]]]:
    """Builds `loss_fn(params, frozen, batch, idx_M, idx_UM) -> (loss, metrics)`.

    Args:
        graphdef: graph definition from `nnx.split(model, trainable, frozen)`.
        spec: the static loss choices.

    Returns:
        The micro-batch loss over groups `idx_M` [M], normalised by the whole minibatch
        `idx_UM` [U, M] (U micro-batches of M groups each, U = grad_accum); differentiable in
        `params`. Given `grad_acc` (a gradient accumulator shaped like `params`), its
        gradient comes out with `grad_acc` added (`fold_accumulator`).
    """
    g = spec.group_size

    def loss_fn(params, frozen, batch: RolloutBatch, idx_M, idx_UM, grad_acc=None):
        rows = group_rows(idx_M, g)

        def take(x, index):
            return jnp.take(x, index, axis=0)

        params, layer_acc = fold_accumulator(params, frozen, grad_acc)
        model = nnx.merge(graphdef, params, frozen)
        mask = take(batch.loss_mask, rows)  # the ids trained on (not tool results)
        packing = None if batch.packing is None else batch.packing.take(idx_M, rows)
        logp, entropy = shared_prefix_logprobs(
            model,
            take(batch.prompt_ids, idx_M),
            take(batch.prompt_mask, idx_M),
            take(batch.tokens, rows),
            take(batch.mask, rows),  # every id of the completion, for attention
            take(batch.temps, rows),
            group_size=g,
            chunk_size=spec.chunk_size,
            packing=packing,
            shared_ids=batch.shared_ids,
            layer_grad_acc=layer_acc,
        )
        sampler_logp = take(batch.sampler_logp, rows)
        old_logp = take(batch.old_logp, rows) if spec.use_old_logp else None
        old_logp, is_weights, lag_metrics = _behaviour(spec, logp, old_logp, sampler_logp, mask)
        norms = loss_normalizers(take(batch.loss_mask, group_rows(idx_UM.reshape(-1), g)))
        loss, metrics = policy_loss(
            logp,
            old_logp,
            take(batch.ref_logp, rows) if spec.use_ref_logp else None,
            take(batch.advantages, rows),
            mask,
            spec.loss,
            entropy=entropy,
            is_weights=is_weights,
            teacher_logp=take(batch.teacher_logp, rows) if spec.use_teacher_logp else None,
            **norms,
        )
        gap = jnp.abs(jax.lax.stop_gradient(logp) - sampler_logp)
        metrics["sampler_logp_gap"] = _masked_mean(gap, mask)
        metrics["sampler_logp_gap_max"] = jnp.max(jnp.where(mask > 0, gap, 0.0))
        metrics.update(lag_metrics)
        return loss, metrics

    return loss_fn
