"""ModelConfig: the frozen description of one Llama/Qwen decoder, and its HF config mapping.

One decoder module covers every supported family; the families differ only in a few flags:

    llama  (Llama 2/3/3.1/3.2, SmolLM2): optional llama3 rope scaling, optional attention bias.
    qwen2  (Qwen2, Qwen2.5): bias on q/k/v, often tied embeddings.
    qwen3  (Qwen3): per-head RMSNorm on q and k, explicit head_dim, no bias.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgrpo.models.layout import Layout

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
REMAT_POLICIES = ("full", "projections")  # ModelConfig.remat_policy


_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapter settings (see `jaxgrpo.models.lora`).

    Attributes:
        rank: R, the adapter rank.
        alpha: scale numerator; the adapter output is multiplied by alpha / rank.
        targets: projections that get an adapter, among q, k, v, o, gate, up, down.
    """

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"Unknown LoRA targets {bad}; choose among {LORA_TARGETS}.")
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a decoder. Hashable, so it can be a jit static argument.

    Attributes:
        arch: "llama", "qwen2" or "qwen3".
        vocab_size: V.
        hidden_size: D.
        intermediate_size: F, the SwiGLU width.
        num_layers: L.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (GQA when K < N).
        head_dim: H.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: None, or llama3 parameters as a sorted tuple of (key, value) pairs
            (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
        max_position_embeddings: context length the checkpoint was trained for.
        qkv_bias: bias on the q, k and v projections (Qwen2).
        o_bias: bias on the output projection (Llama's `attention_bias` sets q/k/v and o).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        tie_embeddings: the LM head reuses the input embedding.
        param_dtype: storage dtype of the weights, "float32" or "bfloat16".
        dtype: compute dtype of matmuls; norms, softmax and logits stay float32.
        remat: recompute each block in the backward pass (jax.checkpoint) to save memory.
        remat_policy: what remat keeps of a block besides its input: "full" nothing (the
            least memory), "projections" the outputs of its projections
            (`layers.PROJECTION_OUTPUTS`), so the backward pass recomputes the attention core
            and elementwise work but no projection.
        lora: adapters declared at construction, or None.
        layout: how the run lays out its work on its backend (kernels, layer and decode
            loops, block sizes; `jaxgrpo.models.layout`); the default is the portable one.
    """

    arch: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    remat_policy: str = "full"
    lora: LoRAConfig | None = None
    layout: Layout = Layout()

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"Unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}."
            )
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy must be one of {', '.join(REMAT_POLICIES)}, "
                f"got {self.remat_policy!r}."
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(
                    f"{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}."
                )

    @property
    def adds_layer_gradients_in_place(self) -> bool:
        """Whether the layer loop can add micro-batch gradients into the running sum inside
        its backward pass (`jaxgrpo.models.accumulate`): unrolled, or with remat; a layer scan
        without remat would stack per-layer copies of what its body closes over."""
        return self.layout.unrolls_layers or self.remat

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Builds a config from a transformers config dict (`LlamaConfig(...).to_dict()`, etc.).

        Args:
            hf: the parsed `config.json`.
            **overrides: fields to set afterwards (e.g. param_dtype, lora, remat).

        Raises:
            ValueError: the model_type is not one of SUPPORTED_ARCHS.
        """
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"Unsupported architecture {arch!r} (architectures={hf.get('architectures')}); "
                f"supported model_type values: {', '.join(SUPPORTED_ARCHS)}."
            )
        # transformers 5 moved rope settings into `rope_parameters`; 4.x used top-level keys.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: default, llama3.")
        scaling = None
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor")
            scaling = {k: float(rope[k]) for k in keys}
            scaling["original_max_position_embeddings"] = float(
                rope["original_max_position_embeddings"]
            )
        heads = hf["num_attention_heads"]
        fields = dict(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            qkv_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
            o_bias=arch == "llama" and bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers `config.json` dict of this model (loads with AutoConfig)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **dict(self.rope_scaling)}
            rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
        hf = {
            "architectures": [_HF_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.param_dtype,
        }
        if self.arch == "llama":
            hf["attention_bias"] = self.qkv_bias or self.o_bias
            hf["mlp_bias"] = False
        if self.arch == "qwen3":
            hf["attention_bias"] = False
        return hf
