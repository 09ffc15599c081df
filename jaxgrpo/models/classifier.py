"""Sequence classifiers: the decoder with a linear ``score`` head read at the last token, the
port of transformers' ``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``
and ``Qwen3ForSequenceClassification`` with one label (a reward model).

    model, tokenizer = load_classifier("path/to/reward_model_dir", mesh=mesh)
    scores_B = model(ids_BT, mask_BT)            # float32, one score per row

The backbone is the policy's ``Transformer``, built and filled by the same code
(``construct.empty_model``, ``weights.load_hf_tensors``): these checkpoints name its tensors
``model.layers...`` as causal LMs do, but have no ``lm_head``. The backbone's config declares
tied embeddings, so no head is allocated or asked for; only ``forward`` (final-normed hidden
states) is ever called. The ``score`` weight [1, D] carries logical axes like every other
weight, so the classifier shards on a mesh by the policy's rules.

Which token is read: transformers takes, per row, the rightmost token whose id is not the
config's ``pad_token_id`` (so left and right padding both work, and a real token equal to the
pad id is skipped as padding); without a pad id, the last position (transformers then accepts
one row only; here the last real token by the mask, which is the same for an unpadded row).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxgrpo.core import presets, sharding
from jaxgrpo.core.errors import UserError
from jaxgrpo.core.shapes import Array
from jaxgrpo.models import Checkpoint, default_layout, read_source
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.construct import empty_model, random_model
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import Tokenizer
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.models.weights import load_hf_tensors

# config.json `architectures` -> our decoder family.
ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
SCORE = "score.weight"  # the head's tensor name, torch layout [num_labels, D]
SCORE_AXES = (None, "embed")  # the label axis (one) replicated, D as every embed axis


class CheckpointError(UserError, ValueError):
    """A checkpoint that is not a one-label sequence classifier of a supported family, or is
    missing; the message names the directory or file."""


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """Static description of a classifier. Hashable, like ``ModelConfig``.

    Attributes:
        backbone: the decoder's config (``tie_embeddings`` set: no LM head is declared).
        pad_id: the id whose positions are padding when the scored token is chosen (the
            checkpoint's ``pad_token_id``); None: the last real token by the mask.
    """

    backbone: ModelConfig
    pad_id: int | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], where: str, **fields: Any) -> ClassifierConfig:
        """The config of a ``config.json`` dict, checked to be a one-label classifier.

        Args:
            hf: the parsed ``config.json``.
            where: its path, for messages.
            **fields: ``ModelConfig`` fields to set (dtype, param_dtype, layout).

        Raises:
            CheckpointError: an architecture other than ``ARCHITECTURES`` or another number
                of labels than one.
        """
        archs = list(hf.get("architectures") or [])
        if not any(a in ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"{where}: architectures {archs} is not a supported sequence classifier; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        labels = hf.get("num_labels", len(hf.get("id2label") or {}) or None)
        if labels is not None and labels != 1:
            raise CheckpointError(
                f"{where}: {labels} labels (num_labels / id2label); a reward model has one"
            )
        try:
            backbone = ModelConfig.from_hf_config(hf, **{**fields, "tie_embeddings": True})
        except ValueError as e:  # an unsupported model_type or rope type
            raise CheckpointError(f"{where}: {e}") from None
        return cls(backbone, hf.get("pad_token_id"))


class SequenceClassifier(nnx.Module):
    """The decoder and its score head: ``model(ids_BT, mask_BT) -> scores_B`` (float32).

    Attributes:
        cfg: the ``ClassifierConfig``.
        backbone: the ``Transformer`` (its ``shard_ctx`` constrains the activations).
        score: the head's weight [1, D], stored as torch stores it.
    """

    def __init__(self, cfg: ClassifierConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.backbone = Transformer(cfg.backbone, rngs=rngs)
        d, dtype = cfg.backbone.hidden_size, cfg.backbone.param_dtype
        w = jax.random.normal(rngs.params(), (1, d), jnp.float32) * 0.02
        self.score = nnx.Param(w.astype(dtype), logical_axes=SCORE_AXES)

    def __call__(self, ids_BT: Array, mask_BT: Array) -> Array:
        """Each row's score at its last non-padding token.

        Args:
            ids_BT: int token ids [B, T], padded on either side with ``cfg.pad_id``.
            mask_BT: 1 on real tokens, 0 on padding.

        Returns:
            float32 [B].
        """
        h_BTD = self.backbone.forward(ids_BT, mask_BT)
        last_B = last_token_index(ids_BT, mask_BT, self.cfg.pad_id)
        h_BD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)[:, 0]
        dtype = self.cfg.backbone.dtype
        scores_B1 = jnp.einsum(
            "BD,YD->BY",
            h_BD.astype(dtype),
            self.score[...].astype(dtype),
            preferred_element_type=jnp.float32,
        )
        return scores_B1[:, 0]


def last_token_index(ids_BT: Array, mask_BT: Array, pad_id: int | None) -> Array:
    """[B] index of each row's rightmost token whose id is not ``pad_id`` (0 for a row of
    padding only), or, without a pad id, its rightmost real token by ``mask_BT``."""
    keep_BT = (mask_BT != 0) if pad_id is None else (ids_BT != pad_id)
    t = ids_BT.shape[1]
    positions_BT = jnp.arange(t, dtype=jnp.int32)[None, :] * keep_BT.astype(jnp.int32)
    return jnp.argmax(positions_BT, axis=-1)


def abstract_classifier(cfg: ClassifierConfig) -> SequenceClassifier:
    """The classifier's structure with ``jax.ShapeDtypeStruct`` leaves: no memory, no compile
    (``nnx.split`` it and lower ``scoring_program`` for an ahead-of-time compile)."""
    return nnx.eval_shape(lambda: SequenceClassifier(cfg, rngs=nnx.Rngs(0)))


def scoring_program(model: SequenceClassifier, mesh: Mesh | None = None):
    """A jitted ``(state, ids_BT, mask_BT) -> scores_B`` float32 of ``model``'s structure
    (``state`` from ``nnx.split(model)``; the graphdef is closed over), the scores replicated
    on ``mesh`` so every process reads them whole."""
    graphdef, _ = nnx.split(model)

    def scores(state, ids_BT, mask_BT):
        return nnx.merge(graphdef, state)(ids_BT, mask_BT)

    if mesh is None:
        return jax.jit(scores)
    return jax.jit(scores, out_shardings=sharding.replicated(mesh))


def _open(source: str) -> tuple[Checkpoint, str]:
    """``read_source`` of a classifier, and the path of its config.json (for messages)."""
    path = os.path.expanduser(os.fspath(source))
    looks_local = os.path.isabs(path) or path.startswith(".")  # else maybe a hub id
    if looks_local and not os.path.exists(path):
        raise CheckpointError(f"reward model directory {path} does not exist")
    try:
        checkpoint = read_source(path)
    except (OSError, ValueError) as e:  # a missing config.json, weights, or hub failure
        raise CheckpointError(f"reward model {source}: {e}") from None
    return checkpoint, os.path.join(path, "config.json")


def _random_hf_config(source: str) -> dict[str, Any]:
    """``random:<name>``: the config.json of a one-label classifier on an ``ARCHITECTURES``
    preset's backbone, padded with the tiny tokenizer's pad id (its tokenizer)."""
    name = source.removeprefix(presets.RANDOM_PREFIX)
    if name not in presets.ARCHITECTURES:
        known = ", ".join(presets.ARCHITECTURES)
        raise CheckpointError(f"unknown architecture {name!r} in {source!r}; known: {known}")
    hf = dict(presets.ARCHITECTURES[name])
    family = {family: arch for arch, family in ARCHITECTURES.items()}[hf["model_type"]]
    return {
        **hf,
        "architectures": [family],
        "num_labels": 1,
        "pad_token_id": tiny_tokenizer().pad_id,
    }


def classifier_config(source: str | os.PathLike, **fields: Any) -> ClassifierConfig:
    """A checkpoint's ``ClassifierConfig`` without loading its weights (for
    ``abstract_classifier`` and an ahead-of-time compile); ``fields`` as ``ModelConfig``'s
    (dtype, param_dtype, layout). ``random:<name>`` is a preset's shape (``load_classifier``
    draws its weights). Raises as ``load_classifier`` does for config.json."""
    source = os.fspath(source)
    if source.startswith(presets.RANDOM_PREFIX):
        return ClassifierConfig.from_hf_config(_random_hf_config(source), source, **fields)
    checkpoint, where = _open(source)
    return ClassifierConfig.from_hf_config(checkpoint.hf_config, where, **fields)


def _random_classifier(source: str, mesh, rules, fields) -> tuple[SequenceClassifier, Tokenizer]:
    """``random:<name>``: random weights of a preset's shape and the tiny tokenizer (compile
    checks and benchmarks, with no download)."""
    cfg = classifier_config(source, **fields)
    model = abstract_classifier(cfg)
    model.backbone = random_model(cfg.backbone, mesh=mesh, rules=rules)
    d = cfg.backbone.hidden_size
    score_YD = np.random.default_rng(0).normal(0.0, 0.02, (1, d))
    _place_score(model, score_YD.astype(jnp.dtype(cfg.backbone.param_dtype)), mesh, rules)
    return model, tiny_tokenizer()


def _place_score(model: SequenceClassifier, score_YD: np.ndarray, mesh, rules) -> None:
    """Puts the score head on ``mesh`` by ``rules`` (one device without a mesh)."""
    where = None
    if mesh is not None:
        spec = sharding.logical_to_spec(
            SCORE_AXES, rules or sharding.TRAIN_RULES, score_YD.shape, mesh
        )
        where = NamedSharding(mesh, spec)
    model.score.set_value(jax.device_put(np.ascontiguousarray(score_YD), where))


def _score_weight(get_tensor, source: str, d: int) -> np.ndarray:
    """The checkpoint's score head [1, D], checked."""
    try:
        score_YD = np.asarray(get_tensor(SCORE))
    except KeyError:
        raise CheckpointError(f"{source}: no score head ({SCORE!r}) in the weights") from None
    if score_YD.ndim != 2 or score_YD.shape[1] != d:
        raise CheckpointError(f"{source}: {SCORE!r} has shape {score_YD.shape}, not (1, {d})")
    if score_YD.shape[0] != 1:
        labels = score_YD.shape[0]
        raise CheckpointError(
            f"{source}: {labels} labels ({SCORE!r} has {labels} rows); a reward model has one"
        )
    return score_YD


def load_classifier(
    source: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules: sharding.Rules | None = None,
    dtype: str = "float32",
    param_dtype: str | None = None,
    pad_id: str = "config",
) -> tuple[SequenceClassifier, Tokenizer]:
    """Load a sequence-classification checkpoint and its tokenizer.

    Args:
        source: a Hugging Face directory (or hub id, downloaded when the hub is reachable)
            whose ``config.json`` names one of ``ARCHITECTURES``, or ``random:<name>``: random
            weights of a ``jaxgrpo.core.presets.ARCHITECTURES`` shape, the tiny tokenizer.
        mesh: parameters are placed sharded by ``rules`` (default ``TRAIN_RULES``) and the
            activations constrained; None: one device.
        dtype: compute dtype, "float32" or "bfloat16" (scores are float32).
        param_dtype: storage dtype of the weights (default ``dtype``).
        pad_id: which id the model reads as padding: ``"config"``, the checkpoint's
            ``pad_token_id`` (as transformers does), or ``"tokenizer"``, the tokenizer's pad
            id (its eos without one), as TRL sets a reward model's.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        CheckpointError: a missing directory, config.json, weights or tokenizer; another
            architecture; more than one label; no ``score.weight``; a tokenizer larger than
            the embedding.
    """
    if pad_id not in ("config", "tokenizer"):
        raise ValueError(f"pad_id must be 'config' or 'tokenizer', got {pad_id!r}")
    fields = dict(dtype=dtype, param_dtype=param_dtype or dtype, layout=default_layout(mesh))
    if os.fspath(source).startswith(presets.RANDOM_PREFIX):
        return _random_classifier(os.fspath(source), mesh, rules, fields)
    checkpoint, where = _open(os.fspath(source))
    get_tensor = checkpoint.get_tensor
    cfg = ClassifierConfig.from_hf_config(checkpoint.hf_config, where, **fields)
    score_YD = _score_weight(get_tensor, source, cfg.backbone.hidden_size)
    try:
        tokenizer = checkpoint.make_tokenizer()
    except OSError as e:
        raise CheckpointError(str(e)) from None
    if tokenizer.vocab_size > cfg.backbone.vocab_size:
        raise CheckpointError(
            f"{source}: the tokenizer's {tokenizer.vocab_size} tokens do not fit the "
            f"embedding's {cfg.backbone.vocab_size} rows"
        )
    if pad_id == "tokenizer":
        cfg = dataclasses.replace(cfg, pad_id=tokenizer.pad_id)
    model = abstract_classifier(cfg)
    model.backbone = empty_model(cfg.backbone, mesh=mesh, rules=rules)
    try:
        load_hf_tensors(model.backbone, get_tensor)
    except (KeyError, ValueError) as e:  # a missing or mis-shaped tensor, named
        raise CheckpointError(f"{source}: {e.args[0]}") from None
    _place_score(model, score_YD.astype(jnp.dtype(cfg.backbone.param_dtype)), mesh, rules)
    return model, tokenizer
