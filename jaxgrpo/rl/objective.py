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
from jaxgrpo.rl.losses import loss_normalizers, policy_loss, truncated_is_weights
from jaxgrpo.rl.rollout import RolloutBatch


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """Static choices of the loss (hashable; closed over by the compiled update).

    Attributes:
        group_size: G.
        loss_type: `policy_loss` preset.
        eps_low / eps_high: clip ranges.
        ratio_cap: cap on the unclipped ratio (TRL's delta); None = off.
        dual_clip: dual-clip constant c > 1; None = off.
        top_entropy_frac: policy gradient on this fraction of highest-entropy tokens of each
            micro-batch; None = all tokens.
        beta: KL coefficient in the loss (0 when the KL goes into the reward).
        kl_estimator: "k1", "k2" or "k3".
        kl_bias_correction: KL times the importance ratio (TRL's use_bias_correction_kl).
        entropy_coef: entropy bonus weight.
        tis_cap: truncated importance-sampling cap; 0 = off.
        use_old_logp: take behaviour log-probs from the batch (several updates per rollout).
        use_ref_logp: add the KL term against the batch's reference log-probs.
        chunk_size: positions per logits block.
        max_completion_length: the constant that dr_grpo divides by (the sampler's
            max_new_tokens; the batch itself may be trimmed to its longest completion).
    """

    group_size: int
    loss_type: str
    eps_low: float
    eps_high: float
    beta: float
    kl_estimator: str
    entropy_coef: float
    tis_cap: float
    use_old_logp: bool
    use_ref_logp: bool
    chunk_size: int = 64
    max_completion_length: int | None = None
    ratio_cap: float | None = None
    dual_clip: float | None = None
    top_entropy_frac: float | None = None
    kl_bias_correction: bool = False

    @classmethod
    def from_config(cls, rl, sampling, *, use_old_logp: bool) -> ObjectiveSpec:
        """The loss of a run: its ``RLConfig`` (``rl``, where 0 turns an option off) and the
        sampler's ``max_new_tokens`` (Dr. GRPO's constant); ``use_old_logp`` is the learner's
        choice (several updates per rollout)."""
        return cls(
            group_size=rl.group_size,
            loss_type=rl.loss_type,
            eps_low=rl.eps_low,
            eps_high=rl.eps_high,
            beta=0.0 if rl.kl_in_reward else rl.beta,
            kl_estimator=rl.kl_estimator,
            kl_bias_correction=rl.kl_bias_correction,
            ratio_cap=rl.ratio_cap or None,
            dual_clip=rl.dual_clip or None,
            top_entropy_frac=rl.top_entropy_frac or None,
            entropy_coef=rl.entropy_coef,
            tis_cap=rl.tis_cap,
            use_old_logp=use_old_logp,
            use_ref_logp=rl.beta > 0 and not rl.kl_in_reward,
            max_completion_length=sampling.max_new_tokens,
        )


def group_rows(idx_M: Array, group_size: int) -> Array:
    """Row indices [M * G] of the completions of groups `idx_M` [M]."""
    return (idx_M[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)


def _masked_mean(x_RT: Array, mask_RT: Array) -> Array:
    m = mask_RT.astype(jnp.float32)
    return jnp.sum(x_RT * m) / jnp.maximum(jnp.sum(m), 1.0)


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
        mask = take(batch.mask, rows)
        packing = None if batch.packing is None else batch.packing.take(idx_M, rows)
        logp, entropy = shared_prefix_logprobs(
            model,
            take(batch.prompt_ids, idx_M),
            take(batch.prompt_mask, idx_M),
            take(batch.tokens, rows),
            mask,
            take(batch.temps, rows),
            group_size=g,
            chunk_size=spec.chunk_size,
            packing=packing,
            shared_ids=batch.shared_ids,
            layer_grad_acc=layer_acc,
        )
        sampler_logp = take(batch.sampler_logp, rows)
        old_logp = take(batch.old_logp, rows) if spec.use_old_logp else None
        behaviour = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
        is_weights = None
        if spec.tis_cap > 0:
            is_weights = truncated_is_weights(behaviour, sampler_logp, spec.tis_cap)
        norms = loss_normalizers(take(batch.mask, group_rows(idx_UM.reshape(-1), g)))
        loss, metrics = policy_loss(
            logp,
            old_logp,
            take(batch.ref_logp, rows) if spec.use_ref_logp else None,
            take(batch.advantages, rows),
            mask,
            loss_type=spec.loss_type,
            eps_low=spec.eps_low,
            eps_high=spec.eps_high,
            beta=spec.beta,
            kl_estimator=spec.kl_estimator,
            kl_bias_correction=spec.kl_bias_correction,
            ratio_cap=spec.ratio_cap,
            dual_clip=spec.dual_clip,
            top_entropy_frac=spec.top_entropy_frac,
            max_completion_length=spec.max_completion_length or batch.tokens.shape[1],
            entropy_coef=spec.entropy_coef,
            entropy=entropy,
            is_weights=is_weights,
            **norms,
        )
        gap = jnp.abs(jax.lax.stop_gradient(logp) - sampler_logp)
        metrics["sampler_logp_gap"] = _masked_mean(gap, mask)
        metrics["sampler_logp_gap_max"] = jnp.max(jnp.where(mask > 0, gap, 0.0))
        return loss, metrics

    return loss_fn
