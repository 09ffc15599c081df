"""Memory per device of a GRPO run: parameters, optimizer state, KV cache, activations.

``python -m jaxgrpo.memory --config gsm8k_hard.py --preset v5e-8`` prints the estimate for one
run on one slice; ``--table`` prints which model sizes fit on which slices (launch/README.md's
table).

The estimate is arithmetic on the model's shapes, with no model built:

* parameters: the exact element count of ``jaxgrpo.models.transformer.Transformer`` (plus LoRA
  A and B), divided evenly over ``fsdp * tensor`` as ``sharding.TRAIN_RULES`` split them;
* trainable state: gradients (with gradient accumulation, the running sum and the
  micro-batch's; full fine-tuning with unrolled layers or remat adds their share in place, so
  only the embedding, head and final norm hold a second one), AdamW's two moments in the
  parameter dtype, and the reference policy's trainable part when ``beta > 0`` (zero LoRA, or a full
  copy for full fine-tuning);
* KV cache of sampling: ``2 * L * rows * (P + T) * K * H`` in the compute dtype, rows =
  ``prompts_per_step * group_size / (data * fsdp)``, K split over ``tensor``;
* the sampler's weights: the decode program reshards the weights to
  ``sharding.sampling_rules`` and lays them out per layer, two copies in the compute dtype,
  split over ``tensor`` when they fit replicated over data x fsdp, else over fsdp x tensor when
  that fits, else one fsdp-sharded copy;
* activations of one micro-batch's update, kept for the backward pass (prefix-shared: the
  prompt once per group, the completions against its repeated cache): per token and layer the
  block's inputs, q/k/v, attention output, MLP hidden and SwiGLU product, plus float32 attention
  scores (packed completions attend in bands, ``models.logprobs.band_layout``); with ``remat`` only
  each block's input is kept (with ``remat_policy="projections"`` also its projections'
  outputs, ``models.layers.PROJECTION_OUTPUTS``), and one block is live at a time. The logits
  are chunked over T (``models.lm_head.head_chunk`` positions), float32. With fsdp > 1 the
  update also holds the embedding, the LM head and two layers' weights gathered whole over
  fsdp.

* second models (a distillation teacher, reward models): their frozen weights in the parameter
  dtype, split over ``fsdp * tensor`` by the same rules; their scoring passes keep no
  activations for a backward pass, so they add to the resident weights only.
* asynchronous rollouts (``rl.max_staleness`` = k >= 1): on shared devices
  (``mesh.sampler_devices`` = 0) the run keeps k more copies of the trainable parameters, the
  versions the sampler may still sample with (``stale_params``); with N > 0 sampler devices the
  learner's chips sample nothing, and ``sampler_side`` sizes the sampler's: the frozen weights
  once, k versions of the trainable ones, the decode's KV cache and its resharded weights.

Parameters, optimizer state and cache are checked against real arrays by the tests; the
activations are an order-of-magnitude figure (XLA fuses and reuses buffers), checked against
XLA's own buffer assignment within a stated factor. For the compiler's own per-program figures
on a real slice, use ``python -m jaxgrpo.compile``; at gsm8k_hard's sizes the compiled update
is larger than this estimate's update phase, which is a lower bound there
(``benchmarks/memory_vs_compiled.py``; benchmarks/README.md, "The memory estimate against
the compiler").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxgrpo.core.sharding import sampling_layout
from jaxgrpo.models.classifier import classifier_config
from jaxgrpo.models.config import LORA_TARGETS, ModelConfig
from jaxgrpo.models.lm_head import head_chunk
from jaxgrpo.models.logprobs import band_layout
from jaxgrpo.rewards.registry import REWARDS
from jaxgrpo.rewards.reward_model import is_model_source
from jaxgrpo.rl.objective import scores_reference
from jaxgrpo.settings.model import model_config as run_model_config
from jaxgrpo.settings.model import model_fields

_BYTES = {"float32": 4, "bfloat16": 2}


def _proj_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(fan-in, fan-out) of each LoRA-able projection of one layer."""
    d, n, k, h, f = (
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    )  # fmt: skip
    return {
        "q": (d, n * h), "k": (d, k * h), "v": (d, k * h), "o": (n * h, d),
        "gate": (d, f), "up": (d, f), "down": (f, d),
    }  # fmt: skip


def base_param_count(cfg: ModelConfig) -> int:
    """Elements of every ``nnx.Param`` that is not a LoRA adapter."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = sum(i * o for i, o in _proj_shapes(cfg).values()) + 2 * d  # + two RMSNorm scales
    layer += (n + 2 * k) * h if cfg.qkv_bias else 0
    layer += d if cfg.o_bias else 0
    layer += 2 * h if cfg.qk_norm else 0
    return cfg.num_layers * layer + outside_layers_param_count(cfg)


def outside_layers_param_count(cfg: ModelConfig) -> int:
    """Elements of the weights outside the stacked layers: embedding, LM head, final norm."""
    d = cfg.hidden_size
    return cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + d


def trainable_param_count(cfg: ModelConfig) -> int:
    """Elements the optimizer trains: the LoRA adapters under LoRA, every weight otherwise."""
    return lora_param_count(cfg) if cfg.lora else base_param_count(cfg)


def lora_param_count(cfg: ModelConfig) -> int:
    """Elements of the LoRA adapters: ``R * (in + out)`` per targeted projection and layer."""
    if cfg.lora is None:
        return 0
    shapes = _proj_shapes(cfg)
    r = cfg.lora.rank
    per_layer = sum(r * sum(shapes[t]) for t in cfg.lora.targets if t in LORA_TARGETS)
    return cfg.num_layers * per_layer


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a step holds at once, from the config.

    Attributes:
      prompts: B, prompts per step.
      group: G, samples per prompt.
      prompt_len: P, prompt bucket length.
      new_tokens: T, max_new_tokens.
      micro_batches: num_minibatches * grad_accum (a micro-batch holds B / this prompts).
      grad_accum: micro-batches summed per update.
      reference: the run keeps a reference policy (``jaxgrpo.rl.objective.scores_reference``).
      packed: ``rl.pack_completions``: the update's rows are a micro-batch's prompts, each
        packing its G completions; they split over data x fsdp only when they divide evenly
        (else every device scores all of them, as ``sharding.batch_sharding`` places them).
      max_staleness: ``rl.max_staleness``, k: the policy versions a batch may lag; the
        sampler keeps k versions of the trainable parameters.
      sampler_devices: ``mesh.sampler_devices``: devices of the sampler's own (0 = shared).
    """

    prompts: int
    group: int
    prompt_len: int
    new_tokens: int
    micro_batches: int = 1
    grad_accum: int = 1
    reference: bool = False
    packed: bool = True
    # Left out of the repr, which `python -m jaxgrpo.memory --table` prints above the
    # synchronous fit table (launch/README.md quotes it).
    max_staleness: int = dataclasses.field(default=0, repr=False)
    sampler_devices: int = dataclasses.field(default=0, repr=False)

    def with_grad_accum(self, grad_accum: int) -> RunShape:
        """The same run with ``grad_accum`` micro-batches per update (minibatches kept)."""
        minibatches = self.micro_batches // self.grad_accum
        return dataclasses.replace(
            self, micro_batches=minibatches * grad_accum, grad_accum=grad_accum
        )


def fitting_grad_accum(run: RunShape, mesh: dict[str, int]) -> int:
    """The largest ``grad_accum`` <= the run's whose micro-batch splits over the mesh.

    A micro-batch of ``prompts * group / (num_minibatches * grad_accum)`` sequences must be a
    multiple of ``data * fsdp`` (``jaxgrpo.settings.schema`` rejects the run otherwise), so a slice
    with more data-parallel devices needs fewer, larger micro-batches: more activation memory.

    Returns:
      That ``grad_accum``, or 0 when even 1 does not split (fewer sequences than devices).
    """
    batch, shards = run.prompts * run.group, mesh["data"] * mesh["fsdp"]
    minibatches = run.micro_batches // run.grad_accum
    for g in range(run.grad_accum, 0, -1):
        split = minibatches * g
        if batch % split == 0 and (batch // split) % shards == 0:
            return g
    return 0


def estimate(
    cfg: ModelConfig,
    run: RunShape,
    mesh: dict[str, int] | None = None,
    hbm_bytes: float | None = None,
    others: Mapping[str, ModelConfig] | None = None,
) -> dict[str, float]:
    """Bytes per device of each part of a step (an even split over the mesh).

    Args:
      cfg: the model (``cfg.lora`` None = full fine-tuning).
      run: batch layout.
      mesh: ``{"data", "fsdp", "tensor"}`` sizes; None = one device. With
        ``run.sampler_devices`` > 0 it is the learner's mesh (``sampler_side`` sizes the
        sampler's).
      hbm_bytes: memory per device, which decides the sampler's weight layout
        (``sharding.sampling_rules``); None = replicated over data x fsdp.
      others: frozen second models by name (``second_models``): a part each.

    Returns:
      ``params`` (frozen + trainable), ``grads``, ``opt_state``, ``ref_params``,
      ``stale_params`` (the k versions the sampler may sample with, on shared devices),
      ``kv_cache``, ``sample_weights`` (the decode program's copies of the weights:
      resharded for sampling and laid out per layer, see ``jaxgrpo.sampling.generate``; both
      0 when the sampler has devices of its own), ``activations`` and ``total`` = the first
      five and the second models + max(kv_cache + sample_weights, activations) (sampling and
      the update do not overlap).
    """
    mesh = {"data": 1, "fsdp": 1, "tensor": 1, **(mesh or {})}
    shard = mesh["fsdp"] * mesh["tensor"]
    rows_split = mesh["data"] * mesh["fsdp"]
    pb = _BYTES[cfg.param_dtype]
    lora = lora_param_count(cfg)
    trainable = trainable_param_count(cfg) * pb / shard
    out = {"params": (base_param_count(cfg) + lora) * pb / shard}
    # Over micro-batches, a second gradient sits beside the running sum; full fine-tuning may
    # add the layers' share into the sum in place (`ModelConfig.adds_layer_gradients_in_place`).
    second = trainable
    if not cfg.lora and cfg.adds_layer_gradients_in_place:
        second = outside_layers_param_count(cfg) * pb / shard
    out["grads"] = trainable + (second if run.grad_accum > 1 else 0.0)
    out["opt_state"] = 2 * trainable
    # LoRA: zero adapters in the state. Full fine-tuning: the initial weights ("params") are
    # the reference, and this is the trained copy the state holds beside them.
    out["ref_params"] = trainable if run.reference else 0.0
    shared = run.sampler_devices == 0
    out["stale_params"] = run.max_staleness * trainable if shared else 0.0
    out["kv_cache"] = _kv_cache(cfg, run, mesh) if shared else 0.0
    out["sample_weights"] = _sample_weights(cfg, mesh, hbm_bytes) if shared else 0.0
    out["activations"] = _activations(cfg, run, rows_split, mesh["tensor"])
    if mesh["fsdp"] > 1:  # the update gathers fsdp-sharded weights whole over fsdp
        out["activations"] += _gathered_weights(cfg) * _BYTES[cfg.dtype] / mesh["tensor"]
    static = sum(out[k] for k in ("params", "grads", "opt_state", "ref_params", "stale_params"))
    for name, other in (others or {}).items():
        out[name] = base_param_count(other) * _BYTES[other.param_dtype] / shard
        static += out[name]
    out["total"] = static + max(out["kv_cache"] + out["sample_weights"], out["activations"])
    return out


def sampler_side(
    cfg: ModelConfig, run: RunShape, mesh: dict[str, int], hbm_bytes: float | None = None
) -> dict[str, float]:
    """Bytes per device of the sampler's own devices (``mesh.sampler_devices`` > 0).

    Args:
      cfg: the policy.
      run: batch layout; ``run.max_staleness`` = k trainable versions are kept.
      mesh: the sampler's mesh (``jaxgrpo.settings.checks.sampler_mesh_shape``).
      hbm_bytes: as in ``estimate``.

    Returns:
      ``frozen`` (the weights no update changes, held once: the base model under LoRA),
      ``trainable_copies`` (k versions of the trainable parameters; the learner sends each
      new one after its update), ``kv_cache`` and ``sample_weights`` (the decode program's),
      and ``total``, their sum. Both weight parts split over fsdp x tensor as
      ``sharding.TRAIN_RULES`` place them, the layout the transfer lands in.
    """
    mesh = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    shard, pb = mesh["fsdp"] * mesh["tensor"], _BYTES[cfg.param_dtype]
    trainable = trainable_param_count(cfg)
    out = {
        "frozen": (base_param_count(cfg) + lora_param_count(cfg) - trainable) * pb / shard,
        "trainable_copies": run.max_staleness * trainable * pb / shard,
        "kv_cache": _kv_cache(cfg, run, mesh),
        "sample_weights": _sample_weights(cfg, mesh, hbm_bytes),
    }
    out["total"] = sum(out.values())
    return out


def _kv_cache(cfg: ModelConfig, run: RunShape, mesh: dict[str, int]) -> float:
    """The sampler's KV cache: ``2 * L * rows * (P + T) * K * H`` in the compute dtype, rows
    over data x fsdp, K over tensor."""
    rows = math.ceil(run.prompts * run.group / (mesh["data"] * mesh["fsdp"]))
    seq = run.prompt_len + run.new_tokens
    kv_heads = max(1, cfg.num_kv_heads // mesh["tensor"])
    return 2.0 * cfg.num_layers * rows * seq * kv_heads * cfg.head_dim * _BYTES[cfg.dtype]


def _sample_weights(cfg: ModelConfig, mesh: dict[str, int], hbm_bytes: float | None) -> float:
    """The decode program's copies of the weights (see the module docstring)."""
    weights = (base_param_count(cfg) + lora_param_count(cfg)) * _BYTES[cfg.dtype]
    layout = "sample" if hbm_bytes is None else sampling_layout(mesh, weights, hbm_bytes)
    shard = mesh["fsdp"] * mesh["tensor"]
    split = {"sample": 2.0 / mesh["tensor"], "sample_tp": 2.0 / shard, "train": 1.0 / shard}
    return weights * split[layout]


def _gathered_weights(cfg: ModelConfig) -> float:
    """Elements the update holds gathered over fsdp at once: the embedding and the LM head
    (each [V, D]) and two layers' weights (the one running and the next, fetched ahead)."""
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    return embed + 2 * (base_param_count(cfg) - embed) / cfg.num_layers


def _activations(cfg: ModelConfig, run: RunShape, rows_split: int, tensor: int) -> float:
    """Bytes kept for the backward pass of one micro-batch (see the module docstring)."""
    cb = _BYTES[cfg.dtype]
    d, f, h, t = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, run.new_tokens
    n, k = cfg.num_heads / tensor, max(1, cfg.num_kv_heads // tensor)
    micro = run.prompts / run.micro_batches  # prompts per micro-batch
    if run.packed:
        prompts = micro / rows_split if micro % rows_split == 0 else micro
        rows = prompts * run.group
    else:  # one row per sequence, split over the devices (each holds its prompts' part)
        rows = micro * run.group / rows_split
        prompts = max(1.0, rows / run.group)
    seq = run.prompt_len + t
    tokens = prompts * run.prompt_len + rows * t
    # Per token and layer: norms' inputs (2D), q and attention output (2NH), k and v (2KH),
    # o output (D), gate/up (2F), SwiGLU product (F).
    per_token = (3 * d + 2 * n * h + 2 * k * h + 3 * f / tensor) * cb
    # float32 attention scores, probabilities and the backward's score gradient (one layer
    # live): prompt queries x prompt keys, completion queries x every key. Packed, a prompt's
    # G completions are one row of G * T queries against P + G * T keys, or against
    # P + (back + 1) W in bands of W columns (`rl.logprobs.band_layout`).
    if run.packed:
        band, back = band_layout(t, run.group * t)
        own = prompts * run.group * t * (run.prompt_len + ((back + 1) * band or run.group * t))
    else:
        own = rows * t * seq
    scores = 3 * 4.0 * n * (prompts * run.prompt_len**2 + own)
    cache = 2.0 * rows * seq * k * h * cb  # the repeated prompt cache, per layer
    layer = tokens * per_token + scores + cache
    if cfg.remat:  # each block's input, and with "projections" `layers.PROJECTION_OUTPUTS`
        projections = 2 * n * h + 2 * k * h + d + 2 * f / tensor
        per_kept = d + (projections if cfg.remat_policy == "projections" else 0)
        kept = cfg.num_layers * tokens * per_kept * cb + layer
    else:
        kept = cfg.num_layers * layer
    # One logits block of each row (`head_chunk`): packed, a row is a prompt's G completions.
    logit_rows = prompts if run.packed else rows
    block = head_chunk(logit_rows, t, min_rows=cfg.layout.head_chunk_rows)
    logits = 3.0 * logit_rows * block * cfg.vocab_size / tensor * 4
    return kept + logits


def second_models(cfg: Any, platform: str = "tpu") -> dict[str, ModelConfig]:
    """The frozen second models of a ``TrainConfig`` that live on its devices, by the name of
    their memory part (``second_model_sources``), in the policy's dtypes; a reward model's is
    its backbone (its score head, one row, is left out)."""
    frozen = dataclasses.replace(cfg.model, lora_rank=0)
    fields = model_fields(frozen, platform)
    dtypes = {k: fields[k] for k in ("dtype", "param_dtype", "layout")}
    out = {}
    for name, (_, source) in second_model_sources(cfg).items():
        if name == "teacher":
            out[name] = run_model_config(frozen, platform, source=source)
        else:
            out[name] = classifier_config(source, **dtypes).backbone
    return out


def second_model_sources(cfg: Any) -> dict[str, tuple[str, str]]:
    """name -> (config key, source) of each second model: ``teacher`` (``teacher.source``, when
    the run uses one) and ``reward_model[i]`` (``rewards.functions[i]`` naming a reward model)."""
    out = {}
    if cfg.teacher.enabled:
        out["teacher"] = ("teacher.source", cfg.teacher.source)
    for i, source in reward_model_sources(cfg).items():
        out[f"reward_model[{i}]"] = (f"rewards.functions[{i}]", source)
    return out


def reward_model_sources(cfg: Any) -> dict[int, str]:
    """``rewards.functions`` entries that name a reward model: index -> source."""
    return {
        i: entry[0]
        for i, entry in enumerate(cfg.rewards.functions)
        if isinstance(entry[0], str) and entry[0] not in REWARDS and is_model_source(entry[0])
    }


def from_train_config(cfg: Any, prompt_len: int, model: str | None = None):
    """(ModelConfig, RunShape) of a ``TrainConfig``; ``model`` replaces ``cfg.model.source``."""
    model_cfg = run_model_config(cfg.model, "tpu", source=model)
    rl = cfg.rl
    run = RunShape(
        prompts=rl.prompts_per_step,
        group=rl.group_size,
        prompt_len=prompt_len,
        new_tokens=cfg.sampling.max_new_tokens,
        micro_batches=rl.num_minibatches * rl.grad_accum,
        grad_accum=rl.grad_accum,
        # The teacher as the KL's target replaces the reference: no copy is kept.
        reference=scores_reference(rl) and not (cfg.teacher.enabled and cfg.teacher.as_reference),
        packed=rl.pack_completions,
        max_staleness=rl.max_staleness,
        sampler_devices=cfg.mesh.sampler_devices,
    )
    return model_cfg, run
