"""Hugging Face tensor names and layouts <-> Transformer parameters.

`load_hf_tensors(model, get_tensor)` fills a model from any source that can produce a tensor by
its HF name in torch layout (safetensors, a torch state dict, dequantised GGUF); `hf_tensors`
is the inverse, and `peft_lora_tensors` exports adapters under PEFT's names.

Layouts. torch Linear weights are [out, in]; ours are [in, *out] with heads explicit (q kernel
[D, N, H]) and stacked over layers. gate_proj and up_proj fill the two halves of the fused
gate_up kernel [D, 2, F]. Embedding and LM head are [V, D] in both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

import jaxgrpo.models.lora as lora_lib
from jaxgrpo.models.config import ModelConfig

_LAYER = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor family: where it lives in our model and how its layout maps.

    Attributes:
        hf: HF name, with {i} for the layer index when per-layer.
        path: attribute path of our nnx.Param from the Transformer.
        hf_shape: torch-layout shape of one HF tensor.
        slot: for gate/up, the index into the fused kernel's axis of size 2.
    """

    hf: str
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    slot: int | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def linear(self) -> bool:
        """A torch Linear weight, stored [out, in] by HF and [in, out] by us."""
        return self.path[-1] == "kernel"


def _entries(cfg: ModelConfig) -> list[_Entry]:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, kh, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    attn, mlp = _LAYER + "self_attn.", _LAYER + "mlp."
    out = [
        _Entry("model.embed_tokens.weight", ("embed",), (v, d)),
        _Entry("model.norm.weight", ("final_norm", "scale"), (d,)),
        _Entry(_LAYER + "input_layernorm.weight", ("layers", "attn_norm", "scale"), (d,)),
        _Entry(_LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), (d,)),
        _Entry(attn + "q_proj.weight", ("layers", "attn", "q", "kernel"), (nh, d)),
        _Entry(attn + "k_proj.weight", ("layers", "attn", "k", "kernel"), (kh, d)),
        _Entry(attn + "v_proj.weight", ("layers", "attn", "v", "kernel"), (kh, d)),
        _Entry(attn + "o_proj.weight", ("layers", "attn", "o", "kernel"), (d, nh)),
        _Entry(mlp + "gate_proj.weight", ("layers", "mlp", "gate_up", "kernel"), (f, d), slot=0),
        _Entry(mlp + "up_proj.weight", ("layers", "mlp", "gate_up", "kernel"), (f, d), slot=1),
        _Entry(mlp + "down_proj.weight", ("layers", "mlp", "down", "kernel"), (d, f)),
    ]
    if not cfg.tie_embeddings:
        out.append(_Entry("lm_head.weight", ("lm_head",), (v, d)))
    if cfg.qkv_bias:
        for name, size in (("q", nh), ("k", kh), ("v", kh)):
            out.append(
                _Entry(attn + f"{name}_proj.bias", ("layers", "attn", name, "bias"), (size,))
            )
    if cfg.o_bias:
        out.append(_Entry(attn + "o_proj.bias", ("layers", "attn", "o", "bias"), (d,)))
    if cfg.qk_norm:
        for name in ("q", "k"):
            out.append(
                _Entry(
                    attn + f"{name}_norm.weight", ("layers", "attn", f"{name}_norm", "scale"), (h,)
                )
            )
    return out


def _param(model, path: tuple[str, ...]) -> nnx.Variable:
    node = model
    for name in path:
        node = getattr(node, name)
    return node


def _to_ours(e: _Entry, w: np.ndarray, ours_shape: tuple[int, ...]) -> np.ndarray:
    """torch [out, in] (or vector) -> our [*in, *out] for one layer."""
    return (w.T if e.linear else w).reshape(ours_shape)


def _to_hf(e: _Entry, w: np.ndarray) -> np.ndarray:
    """Our per-layer [*in, *out] -> torch [out, in] (or vector)."""
    if e.linear:
        out_size, in_size = e.hf_shape
        return np.ascontiguousarray(w.reshape(in_size, out_size).T)
    return w.reshape(e.hf_shape)


def _fetch(get_tensor: Callable[[str], np.ndarray], name: str, expected: tuple[int, ...]):
    try:
        w = get_tensor(name)
    except KeyError:
        w = None
    if w is None:
        raise KeyError(f"Missing tensor {name!r} (expected shape {expected}).")
    w = np.asarray(w)
    if tuple(w.shape) != tuple(expected):
        raise ValueError(f"Tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(expected)}.")
    return w


# XLA:CPU adopts a host buffer as a device array without copying it when the buffer is aligned
# to this many bytes; numpy's own allocations are 16-byte aligned.
_XLA_CPU_ALIGN = 64


def adoptable_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised host array that `jax.device_put` to a CPU device takes over without a
    copy (64-byte aligned), so filling weights on the host and placing them holds one copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _XLA_CPU_ALIGN, np.uint8)
    start = -raw.ctypes.data % _XLA_CPU_ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def read_bytes(path: str, begin: int, count: int) -> np.ndarray:
    """`count` bytes of a checkpoint file from offset `begin`, as a fresh uint8 array.

    Checkpoint readers use this instead of a memory map: the pages of a mapped file stay in
    the process's resident memory until it is unmapped, so a load held the whole file next to
    the weights it placed.

    Raises:
        ValueError: the file ends before `begin + count` (naming the file).
    """
    with open(path, "rb") as f:
        data = np.fromfile(f, dtype=np.uint8, count=count, offset=begin)
    if data.size != count:
        raise ValueError(f"{path} is truncated: {count} bytes expected at offset {begin}.")
    return data


def load_hf_tensors(model, get_tensor: Callable[[str], np.ndarray]) -> None:
    """Fills `model`'s base weights in place from HF-named torch-layout tensors.

    The model may be abstract (`nnx.eval_shape(lambda: Transformer(cfg, rngs=...))`): every
    base weight is replaced, so no random initialisation is needed. Values go to the sharding
    already on each parameter (a NamedSharding from `jaxgrpo.models.construct` or
    `nnx.as_abstract`), else to the default device.

    Args:
        model: a Transformer (adapters, if any, are left as they are).
        get_tensor: name -> array, e.g. `lambda n: state_dict[n].numpy()`.

    Raises:
        KeyError: a tensor is missing (named, with its expected shape).
        ValueError: a tensor has the wrong shape (named, with expected and found shapes).
    """
    cfg = model.cfg
    families: dict[tuple[str, ...], list[_Entry]] = {}
    for e in _entries(cfg):  # gate_proj and up_proj fill the two halves of one fused kernel
        families.setdefault(e.path, []).append(e)
    # One parameter at a time, assembled in place and placed at once, so a load holds at most
    # one parameter's host copy next to the placed weights (not a second copy of the model).
    for path, entries in families.items():
        var = _param(model, path)
        current = var.get_value()
        value = adoptable_empty(current.shape, current.dtype)
        for e in entries:
            layers = range(cfg.num_layers) if e.per_layer else [None]
            for i in layers:
                out = value if i is None else value[i]
                if e.slot is not None:
                    out = out[..., e.slot, :]
                name = e.hf if i is None else e.hf.format(i=i)
                out[...] = _to_ours(e, _fetch(get_tensor, name, e.hf_shape), out.shape)
        # device_put (jnp.asarray copies) hands XLA:CPU the aligned host buffer itself.
        var.set_value(jax.device_put(value, getattr(current, "sharding", None)))
        del value


def hf_tensors(model, merge_lora: bool = True) -> dict[str, np.ndarray]:
    """All base weights under their HF names in torch layout (float32 or the param dtype).

    Args:
        model: a Transformer.
        merge_lora: fold adapters into the weights first (on a copy; `model` is unchanged).
    """
    if merge_lora and model.cfg.lora is not None:
        model = lora_lib.merge(nnx.clone(model))
    cfg = model.cfg
    out: dict[str, np.ndarray] = {}
    for e in _entries(cfg):
        value = np.asarray(jax.device_get(_param(model, e.path)[...]))
        if e.slot is not None:
            value = value[..., e.slot, :]
        if e.per_layer:
            for i in range(cfg.num_layers):
                out[e.hf.format(i=i)] = _to_hf(e, value[i])
        else:
            out[e.hf] = _to_hf(e, value)
    return out


_PEFT_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def _adapters(model) -> dict[str, lora_lib.LoRA | None]:
    attn, mlp = model.layers.attn, model.layers.mlp
    return {
        "q": attn.q.lora,
        "k": attn.k.lora,
        "v": attn.v.lora,
        "o": attn.o.lora,
        "gate": mlp.gate_lora,
        "up": mlp.up_lora,
        "down": mlp.down.lora,
    }


def peft_lora_tensors(model) -> dict[str, np.ndarray]:
    """Adapters under PEFT names: lora_A.weight [r, in] and lora_B.weight [out, r] per layer.

    PEFT multiplies by lora_alpha / r itself, so A and B are exported unscaled; write
    `peft_adapter_config(model.cfg)` next to them.
    """
    out: dict[str, np.ndarray] = {}
    for target, adapter in _adapters(model).items():
        if adapter is None:
            continue
        a = np.asarray(jax.device_get(adapter.lora_a[...]), np.float32)
        b = np.asarray(jax.device_get(adapter.lora_b[...]), np.float32)
        r = a.shape[-1]
        for i in range(model.cfg.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{_PEFT_MODULES[target]}"
            out[prefix + ".lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            out[prefix + ".lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    return out


def peft_adapter_config(cfg: ModelConfig, base_model_name_or_path: str = "") -> dict:
    """The `adapter_config.json` dict matching `peft_lora_tensors`."""
    assert cfg.lora is not None, "model has no LoRA adapters"
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": [_PEFT_MODULES[t].split(".")[1] for t in cfg.lora.targets],
    }
