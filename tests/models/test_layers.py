"""Per-component parity with transformers' Llama modules: RMSNorm, RoPE (+llama3), attention, block.

Weights are loaded into our model through `load_hf_tensors` (the same path as checkpoints), and
each component is compared at float32 with rtol = atol = 1e-4 on unpadded positions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.layers import (
    apply_rope,
    attend,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxgrpo.models.transformer import Transformer, layer_block
from jaxgrpo.models.weights import load_hf_tensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_config(num_kv_heads=2, rope=None, bias=False):
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        rope_theta=500000.0,
        rope_scaling=rope,
        attention_bias=bias,
        rms_norm_eps=1e-5,
    )


def _pair(hf_cfg, seed=0):
    """A random 1-layer HF Llama (with perturbed norms/biases) and our model loaded from it."""
    torch.manual_seed(seed)
    tm = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in tm.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.numpy() for k, v in tm.state_dict().items()}
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(1)))
    load_hf_tensors(model, lambda n: sd[n])
    return tm, model


def _left_padded(b=3, t=10, d=64, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(b, t, d).astype(np.float32)
    mask = np.ones((b, t), bool)
    mask[1, :3] = False
    mask[2, :6] = False
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return x, mask, pos


def _hf_additive_mask(mask):
    t = mask.shape[1]
    allowed = mask[:, None, :] & np.tril(np.ones((t, t), bool))[None]
    return torch.tensor(np.where(allowed, 0.0, -1e9)[:, None].astype(np.float32))


def _mask_BTS(mask_BT):
    t = mask_BT.shape[1]
    return mask_BT[:, None, :] & jnp.tril(jnp.ones((t, t), bool))[None]


def test_rmsnorm_matches_hf():
    norm = hf_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = np.random.RandomState(0).randn(2, 5, 64).astype(np.float32) * 3
    ref = norm(torch.tensor(x)).detach().numpy()
    ours = rms_norm(jnp.asarray(x), jnp.asarray(norm.weight.detach().numpy()), 1e-5)
    np.testing.assert_allclose(np.asarray(ours), ref, **TOL)


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rope_matches_hf(rope):
    hf_cfg = _hf_config(rope=rope)
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    rotary = hf_llama.LlamaRotaryEmbedding(hf_cfg)
    np.testing.assert_allclose(rope_inv_freq(cfg), rotary.inv_freq.numpy(), rtol=1e-6)
    # Positions up to 40 > original_max_position_embeddings so all llama3 bands are exercised.
    pos = np.stack([np.arange(40), np.arange(40) * 3 + 7])
    q = np.random.RandomState(0).randn(2, 40, 4, 16).astype(np.float32)
    cos_t, sin_t = rotary(torch.tensor(q), torch.tensor(pos))
    ref, _ = hf_llama.apply_rotary_pos_emb(
        torch.tensor(q).transpose(1, 2), torch.tensor(q).transpose(1, 2), cos_t, sin_t
    )
    cos, sin = rope_cos_sin(jnp.asarray(pos), rope_inv_freq(cfg))
    ours = apply_rope(jnp.asarray(q), cos, sin)
    np.testing.assert_allclose(np.asarray(ours), ref.transpose(1, 2).numpy(), **TOL)


def _hf_rope(tm, x, pos):
    return tm.model.rotary_emb(torch.tensor(x), torch.tensor(pos))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_attention_matches_hf(num_kv_heads):
    tm, model = _pair(_hf_config(num_kv_heads, rope=LLAMA3_ROPE, bias=True))
    x, mask, pos = _left_padded()
    with torch.no_grad():
        ref, _ = tm.model.layers[0].self_attn(
            torch.tensor(x),
            position_embeddings=_hf_rope(tm, x, pos),
            attention_mask=_hf_additive_mask(mask),
        )

    @jax.jit
    def ours_fn(model, x, pos, mask):
        block = layer_block(model, 0)
        cos, sin = rope_cos_sin(pos, rope_inv_freq(model.cfg))
        q, k, v = block.attn.qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return block.attn.o(attend(q, k, v, _mask_BTS(mask)))

    ours = ours_fn(model, x, pos, mask)
    np.testing.assert_allclose(np.asarray(ours)[mask], ref.numpy()[mask], **TOL)


def test_block_matches_hf():
    tm, model = _pair(_hf_config(2, rope=LLAMA3_ROPE), seed=3)
    x, mask, pos = _left_padded(seed=1)
    with torch.no_grad():
        ref = tm.model.layers[0](
            torch.tensor(x),
            attention_mask=_hf_additive_mask(mask),
            position_embeddings=_hf_rope(tm, x, pos),
        )
    ref = ref[0] if isinstance(ref, tuple) else ref

    @jax.jit
    def ours_fn(model, x, pos, mask):
        cos, sin = rope_cos_sin(pos, rope_inv_freq(model.cfg))
        out, kv = layer_block(model, 0)(x, cos, sin, _mask_BTS(mask))
        assert kv is None
        return out

    ours = ours_fn(model, x, pos, mask)
    np.testing.assert_allclose(np.asarray(ours)[mask], ref.numpy()[mask], **TOL)


def test_fully_masked_query_rows_stay_finite():
    """A left-pad query sees no key; it must give finite values (not NaN) so grads stay clean."""
    q = jnp.ones((1, 2, 2, 4))
    k = v = jnp.ones((1, 2, 1, 4))
    mask = jnp.array([[[False, False], [False, True]]])
    out = jax.jit(attend)(q, k, v, mask)
    assert bool(jnp.all(jnp.isfinite(out)))
    grads = jax.jit(jax.grad(lambda q: attend(q, k, v, mask).sum()))(q)
    assert bool(jnp.all(jnp.isfinite(grads)))
