"""Export to Hugging Face layouts: merged weights (transformers) and LoRA adapters (PEFT).

    export_hf(model, tokenizer, "out/merged")          # AutoModelForCausalLM.from_pretrained
    export_peft(model, "out/adapter", "org/base")      # PeftModel.from_pretrained(base, ...)
    python -m jaxgrpo.models.export SRC OUT [--dtype bfloat16]

Both write into a temporary sibling directory and rename it into place, so a crash never leaves a
half-written checkpoint where a serving stack would pick it up. Safetensors files are written
directly (8-byte header size, JSON header, raw bytes), which covers bfloat16 without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable

import ml_dtypes
import numpy as np

from jaxgrpo.models import load_model
from jaxgrpo.models.weights import hf_tensors, peft_adapter_config, peft_lora_tensors

_ST_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def save_safetensors(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
    """Write ``{name: array}`` as one safetensors file (names sorted, 8-byte aligned header)."""
    header, offset = {}, 0
    arrays = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
    for name, a in arrays.items():
        header[name] = {
            "dtype": _ST_NAMES[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(a.tobytes())


def _save_sharded(tensors: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when over the limit."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, os.path.join(out_dir, fname))
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(index, os.path.join(out_dir, "model.safetensors.index.json"))


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _atomic_dir(out_dir: str, write: Callable[[str], None]) -> str:
    """Run ``write(tmp_dir)`` then move ``tmp_dir`` to ``out_dir`` (replacing it)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        write(tmp)
        if os.path.exists(out_dir):
            old = tmp + ".old"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_hf(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> str:
    """Write a Hugging Face checkpoint with LoRA adapters merged into the weights.

    Args:
      model: a ``Transformer`` (its adapters, if any, are folded in on a copy).
      tokenizer: a ``jaxgrpo.models.Tokenizer`` (or None to skip tokenizer files).
      out_dir: destination directory; replaced atomically if it exists.
      dtype: "float32" or "bfloat16" for the stored weights (default: the model's param dtype).
      max_shard_bytes: split the weights into shards with an index above this size.

    Returns:
      The absolute path of ``out_dir`` (config.json, generation_config.json, model.safetensors or
      shards + index, tokenizer files).
    """
    cfg = model.cfg
    dtype = dtype or cfg.param_dtype
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {k: np.asarray(v).astype(np_dtype) for k, v in hf_tensors(model).items()}
    config = cfg.to_hf_config()
    config["torch_dtype"] = dtype
    generation = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id}
        ids = {k: v for k, v in ids.items() if v is not None}
        config.update(ids, eos_token_id=tokenizer.eos_ids[0])
        generation = {**ids, "eos_token_id": list(tokenizer.eos_ids)}

    def write(tmp: str) -> None:
        _save_sharded(tensors, tmp, max_shard_bytes)
        _write_json(config, os.path.join(tmp, "config.json"))
        if tokenizer is not None:
            _write_json(generation, os.path.join(tmp, "generation_config.json"))
            tokenizer.save_pretrained(tmp)

    return _atomic_dir(out_dir, write)


def export_peft(model, out_dir: str | os.PathLike, base_model_name_or_path: str = "") -> str:
    """Write the LoRA adapters only, in PEFT's layout (adapter_config.json + safetensors).

    Args:
      model: a ``Transformer`` built with ``ModelConfig.lora``.
      out_dir: destination directory; replaced atomically if it exists.
      base_model_name_or_path: recorded in adapter_config.json for ``PeftModel`` / ``AutoPeft``.

    Returns:
      The absolute path of ``out_dir``.
    """
    if model.cfg.lora is None:
        raise ValueError("export_peft needs a model with LoRA adapters (ModelConfig.lora is None).")
    tensors = peft_lora_tensors(model)
    config = peft_adapter_config(model.cfg, base_model_name_or_path)

    def write(tmp: str) -> None:
        save_safetensors(tensors, os.path.join(tmp, "adapter_model.safetensors"))
        _write_json(config, os.path.join(tmp, "adapter_config.json"))

    return _atomic_dir(out_dir, write)


def main(argv: list[str] | None = None) -> None:
    """``python -m jaxgrpo.models.export SRC OUT``: convert any loadable source (e.g. a GGUF) to
    a Hugging Face directory."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("src", help="Hugging Face directory, hub id or .gguf file")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.src, dtype=args.dtype)
    print(export_hf(model, tokenizer, args.out))


if __name__ == "__main__":
    main()
