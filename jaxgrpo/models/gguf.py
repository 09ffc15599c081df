"""Reading llama.cpp GGUF checkpoints: config, lazily dequantized tensors, tokenizer.

A GGUF file carries everything a Hugging Face directory does, under llama.cpp's names: the
hyperparameters as ``{arch}.*`` metadata, the weights as (often quantized) tensors named
``blk.N.attn_q.weight`` and so on, and the tokenizer as ``tokenizer.ggml.*`` arrays plus a chat
template. This module translates all three to the Hugging Face vocabulary, so the rest of the
package has one import path (``weights.load_hf_tensors``) and one tokenizer type:

    ckpt = GGUFCheckpoint(path)
    cfg = ModelConfig.from_hf_config(ckpt.hf_config())
    load_hf_tensors(model, ckpt.get_tensor)   # HF names, torch [out, in] layout, float32
    tok = Tokenizer.from_gguf(ckpt)           # in jaxgrpo.models.tokenizer

``get_tensor`` reads and dequantizes one tensor when asked (``weights.read_bytes``, not a memory
map), so a large model is never materialised twice on the host.

Two llama.cpp conventions are undone here. (1) For the Llama architecture, ``convert_hf_to_gguf``
permutes the rows of q and k from Hugging Face's rotate-half RoPE layout into GPT-J's interleaved
layout; ``_unpermute_rows`` inverts it. Qwen2/Qwen3 files use the NEOX (rotate-half) layout and are
stored unpermuted. (2) Llama 3.1-style RoPE scaling is stored as a ``rope_freqs`` tensor of
per-frequency divisors rather than as parameters; ``_llama3_scaling`` recovers the parameters and
checks they reproduce the tensor.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Callable

import numpy as np

from jaxgrpo.models.weights import read_bytes

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# GGUF tensor name -> Hugging Face name. `{i}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors that carry configuration, not parameters.
_CONFIG_TENSORS = ("rope_freqs.weight",)


def gguf_to_hf_name(name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, or None for a tensor that is not a parameter."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves).

    ``convert_hf_to_gguf`` maps each head's rows ``[h0 | h1]`` (two halves of H/2) to the
    interleaving ``h0[0], h1[0], h0[1], h1[1], ...``, i.e. ``reshape(N, 2, H/2).swapaxes(1, 2)``.
    The inverse is ``reshape(N, H/2, 2).swapaxes(1, 2)``, for weights [N*H, D] and biases [N*H].

    Args:
      w: q or k projection rows as stored in the GGUF, leading dim ``n_heads * head_dim``.
      n_heads: number of heads these rows belong to (query heads for q, kv heads for k).

    Returns:
      The rows in Hugging Face order, same shape as ``w``.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(head_dim, theta, factor, low, high, original_ctx) -> np.ndarray:
    """Per-frequency RoPE divisors of Llama 3.1 scaling, as llama.cpp's converter writes them."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    low_freq = np.where(wavelen > original_ctx / low, factor, mid)
    return np.where(wavelen < original_ctx / high, 1.0, low_freq)


def _llama3_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float, ctx: int | None) -> dict:
    """Recover Llama 3.1 rope_scaling parameters from a GGUF ``rope_freqs`` tensor.

    The file stores only the resulting divisors. Every released Llama 3.x uses low/high frequency
    factors 1 and 4; ``factor`` is the largest divisor. The original context is read off any
    frequency in the smooth band (there ``1/div = (1 - s)/factor + s`` with
    ``s = (ctx / wavelen - 1) / 3``), else tried among 8192, the metadata value and powers of
    two. Parameters are accepted only if they reproduce the whole tensor (rtol 1e-4).
    """
    factor = float(np.max(rope_freqs))
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    candidates = [8192, ctx]
    if factor > 1:
        s = (1.0 / rope_freqs.astype(np.float64) - 1.0 / factor) / (1.0 - 1.0 / factor)
        smooth = (s > 1e-6) & (s < 1 - 1e-6)
        candidates += [int(round(c)) for c in (wavelen * (1 + 3 * s))[smooth]]
    candidates += [2**k for k in range(4, 21)]
    for original_ctx in dict.fromkeys(c for c in candidates if c):
        expected = _llama3_factors(head_dim, theta, factor, 1.0, 4.0, original_ctx)
        if expected.shape == rope_freqs.shape and np.allclose(expected, rope_freqs, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": original_ctx,
            }
    raise ValueError(
        "GGUF rope_freqs tensor does not match Llama 3 rope scaling with low/high frequency "
        f"factors 1/4 (factor {factor}); this RoPE scaling is not supported."
    )


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """Dequantize one GGUF tensor's raw rows to float32 (torch layout).

    Q8_0 / Q4_0 / Q4_1 (the types of the common small-model files) take a vectorised path about
    3x faster than ``gguf.quants.dequantize``, which handles every other type. Block layouts
    (ggml-common.h), 32 values per block: Q8_0 = f16 d + 32 int8 (x = d q); Q4_0 = f16 d + 16
    bytes of nibbles, low nibbles first (x = d (q - 8)); Q4_1 = f16 d, f16 m + nibbles
    (x = d q + m).
    """
    # the `gguf` package: optional, needed only for GGUF files
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize

    if qtype not in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        return np.asarray(gguf_dequantize(data, qtype), dtype=np.float32)
    block = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    rows = data.reshape(-1, block)
    d = rows[:, :2].copy().view(np.float16).astype(np.float32)
    if qtype == Q.Q8_0:
        x = rows[:, 2:].view(np.int8).astype(np.float32) * d
    else:
        nibbles = rows[:, block - 16 :]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
        if qtype == Q.Q4_0:
            x = (q - 8.0) * d
        else:
            x = q * d + rows[:, 2:4].copy().view(np.float16).astype(np.float32)
    return x.reshape(*data.shape[:-1], -1)


# GGUF value types (gguf spec): scalar struct formats, 8 = string, 9 = array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reads over the file's header bytes."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("I"), self.scalar("Q")
            if etype in _SCALARS and etype != 7:
                fmt = _SCALARS[etype]
                values = struct.unpack_from(f"<{n}{fmt}", self.buf, self.pos)
                self.pos += n * struct.calcsize(fmt)
                return list(values)
            return [self.value(etype) for _ in range(n)]
        return self.scalar(_SCALARS[vtype])


def read_gguf_header(path: str) -> tuple[dict, dict, int]:
    """Parse a GGUF (v2/v3) header: metadata, tensor infos and the data offset.

    ``gguf.GGUFReader`` wraps every metadata array element in a numpy view, which took ~10 s for
    SmolLM2's 100k tokenizer strings; plain ``struct`` reads take well under a second.

    Returns:
      ``(metadata, tensors, data_start)``: ``{key: value}``, ``{name: (ggml_dims, type, offset)}``
      (dims innermost first, as ggml orders them) and the byte offset of tensor data.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic).")
        return _parse_header(_Cursor(buf), path)


def _parse_header(cur: _Cursor, path: str) -> tuple[dict, dict, int]:
    cur.pos = 4
    version = cur.scalar("I")
    if version < 2:
        raise ValueError(f"GGUF version {version} of {path} is not supported (need 2 or 3).")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    tensors = {}
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        tensors[name] = (dims, cur.scalar("I"), cur.scalar("Q"))
    align = metadata.get("general.alignment", 32)
    return metadata, tensors, -(-cur.pos // align) * align


class GGUFCheckpoint:
    """A GGUF file seen through Hugging Face names; tensors dequantized on demand.

    Attributes:
      path: the file.
      architecture: ``general.architecture`` (one of ``SUPPORTED_ARCHITECTURES``).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self._meta, self._tensors, self._data_start = read_gguf_header(self.path)
        self.architecture = self.meta("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {self.architecture!r} in {self.path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        self._hf_to_gguf = {}
        for name in self._tensors:
            hf_name = gguf_to_hf_name(name)
            if hf_name is not None:
                self._hf_to_gguf[hf_name] = name
            elif name not in _CONFIG_TENSORS:
                raise ValueError(f"GGUF tensor {name!r} has no Hugging Face name ({self.path}).")

    def meta(self, key: str, default=None):
        """A metadata value (int, float, bool, str or list), or ``default`` when absent."""
        return self._meta.get(key, default)

    def _arch_meta(self, key: str, default=None):
        return self.meta(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        """Hugging Face names of every parameter tensor in the file."""
        return list(self._hf_to_gguf)

    def _raw(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32 with numpy dims (outermost first), read from the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # optional, as above

        dims, qtype, offset = self._tensors[gguf_name]
        qtype = GGMLQuantizationType(qtype)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        row_bytes = shape[-1] // block * block_bytes
        begin = self._data_start + offset
        raw = read_bytes(self.path, begin, row_bytes * math.prod(shape[:-1]))
        raw = raw.reshape(*shape[:-1], row_bytes)
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32)
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32)
        if qtype == GGMLQuantizationType.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return dequantize(raw, qtype)

    def get_tensor(self, hf_name: str) -> np.ndarray:
        """Dequantized float32 tensor in torch layout (weights [out, in]).

        Raises:
          KeyError: naming the tensor and the file when it is absent.
        """
        if hf_name not in self._hf_to_gguf:
            raise KeyError(f"Tensor {hf_name!r} not found in GGUF file {self.path}.")
        w = self._raw(self._hf_to_gguf[hf_name])
        if self.architecture == "llama":
            if ".q_proj." in hf_name:
                w = _unpermute_rows(w, self._arch_meta("attention.head_count"))
            elif ".k_proj." in hf_name:
                heads = self._arch_meta("attention.head_count")
                w = _unpermute_rows(w, self._arch_meta("attention.head_count_kv", heads))
        return w

    def hf_config(self) -> dict:
        """A Hugging Face ``config.json`` dict for this model (``ModelConfig.from_hf_config``)."""
        hidden = self._arch_meta("embedding_length")
        heads = self._arch_meta("attention.head_count")
        head_dim = self._arch_meta("attention.key_length") or self._arch_meta(
            "rope.dimension_count", hidden // heads
        )
        theta = float(self._arch_meta("rope.freq_base", 10000.0))
        ctx = self._arch_meta("context_length", 2048)
        vocab = self._arch_meta("vocab_size") or self._tensors["token_embd.weight"][0][-1]
        hf_arch, model_type = _HF_ARCH[self.architecture]
        config = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": int(vocab),
            "hidden_size": int(hidden),
            "intermediate_size": int(self._arch_meta("feed_forward_length")),
            "num_hidden_layers": int(self._arch_meta("block_count")),
            "num_attention_heads": int(heads),
            "num_key_value_heads": int(self._arch_meta("attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(self._arch_meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta,
            "rope_scaling": self._rope_scaling(int(head_dim), theta),
            "max_position_embeddings": int(ctx),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta("tokenizer.ggml.eos_token_id"),
        }
        if self.architecture != "qwen2":  # Qwen2 always has q/k/v bias; the others say so.
            config["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
        return config

    def _rope_scaling(self, head_dim: int, theta: float) -> dict | None:
        kind = self._arch_meta("rope.scaling.type")
        if "rope_freqs.weight" in self._tensors:
            ctx = self._arch_meta("rope.scaling.original_context_length")
            return _llama3_scaling(self._raw("rope_freqs.weight"), head_dim, theta, ctx)
        if kind in (None, "none"):
            return None
        raise ValueError(
            f"Unsupported RoPE scaling {kind!r} in {self.path}; "
            "supported: none, llama3 (rope_freqs tensor)."
        )


def gguf_tensor_getter(path: str) -> Callable[[str], np.ndarray]:
    """``get_tensor(hf_name)`` for a GGUF file (convenience for ``weights.load_hf_tensors``)."""
    return GGUFCheckpoint(path).get_tensor
