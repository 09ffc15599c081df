"""The decoder against transformers (Llama+llama3 rope, Qwen2 tied+bias, Qwen3 qk-norm), the KV
cache against the full forward, weight round trips and error messages, remat and compile time.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.construct import random_model
from jaxgrpo.models.kv_cache import LayerKVCache, init_cache
from jaxgrpo.models.layout import Layout
from jaxgrpo.models.transformer import Segment, Transformer
from jaxgrpo.models.weights import hf_tensors, load_hf_tensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_hf import LLAMA3_ROPE, llama_config, qwen2_config, qwen3_config  # noqa: E402

# This file's variations on the shared tiny configs: HF's default initializer range (small
# logits, which the absolute 1e-4 tolerances below were set for), a narrower MLP, llama3 rope
# with theta 5e5 and an original context of 8 (rescaled bands inside the 12-token batch), and a
# Qwen3 head_dim (32) that differs from D / heads.
VARIANT = dict(intermediate_size=96, rms_norm_eps=1e-5, initializer_range=0.02)
ARCHS = {
    "llama": (
        lambda: llama_config(
            **VARIANT,
            rope_theta=500000.0,
            rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8},
        ),
        "LlamaForCausalLM",
    ),
    "qwen2": (lambda: qwen2_config(**VARIANT), "Qwen2ForCausalLM"),
    "qwen3": (lambda: qwen3_config(**VARIANT, head_dim=32), "Qwen3ForCausalLM"),
}


def _build(arch):
    """A random tiny HF model (norms, biases perturbed off init) and ours loaded from it."""
    make_config, model_cls = ARCHS[arch]
    hf_cfg = make_config()
    torch.manual_seed(0)
    tm = getattr(transformers, model_cls)(hf_cfg).eval()
    with torch.no_grad():
        for name, p in tm.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.numpy() for k, v in tm.state_dict().items()}
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    load_hf_tensors(model, lambda n: sd[n])
    return tm, model, sd


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    return _build(request.param)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 256, (3, 12)).astype(np.int32)
    mask = np.ones((3, 12), np.int32)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return ids, mask


@jax.jit
def _forward(model, ids, mask):
    return model(ids, attention_mask=mask)


def test_logits_match_transformers(pair, batch):
    """float32 logits within rtol = atol = 1e-4 and identical argmax at every unpadded position."""
    tm, model, _ = pair
    ids, mask = batch
    with torch.no_grad():
        ref = tm(torch.tensor(ids).long(), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(_forward(model, ids, mask))
    assert ours.dtype == np.float32
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(ours[valid].argmax(-1), ref[valid].argmax(-1))
    assert np.all(np.isfinite(ours)), "padded positions must give finite values"


@functools.partial(jax.jit, static_argnums=(3, 4))
def _cached(model, ids, mask, prefill_len, group):
    """Prefill `prefill_len` tokens, then decode the rest one token at a time; separately, repeat
    the prefilled cache `group` times and decode the next token on every copy."""
    b, t = ids.shape
    cache = init_cache(model.cfg, b, t + 2)
    h, cache = model.prefill(ids[:, :prefill_len], mask[:, :prefill_len], cache)
    outs, grouped = [model.logits(h)], cache.repeat(group)
    for i in range(prefill_len, t):
        h, cache = model.prefill(ids[:, i : i + 1], jnp.ones((b, 1), jnp.int32), cache)
        outs.append(model.logits(h))
    nxt = jnp.repeat(ids[:, prefill_len : prefill_len + 1], group, axis=0)
    h, _ = model.prefill(nxt, jnp.ones((b * group, 1), jnp.int32), grouped)
    return jnp.concatenate(outs, axis=1), cache, model.logits(h)[:, 0]


def test_cached_decoding_equals_full_forward(pair, batch):
    """Prefill + 1-token steps, and a repeat(G) cache, reproduce the full forward (1e-5)."""
    _, model, _ = pair
    ids, mask = batch
    full = np.asarray(_forward(model, ids, mask))
    cached, cache, grouped = _cached(model, ids, mask, 10, 2)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(cached)[valid], full[valid], rtol=1e-5, atol=1e-5)
    assert int(cache.index) == 12
    np.testing.assert_array_equal(np.asarray(cache.next_pos), mask.sum(1))
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :12], valid)
    # Row b of the prompt batch becomes rows 2b and 2b+1 of the grouped batch.
    expected = np.repeat(full[:, 10], 2, axis=0)
    np.testing.assert_allclose(np.asarray(grouped), expected, rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(3,))
def _prefix_pass(model, ids, mask, split):
    """Tokens [0, split) and [split, T) as two segments of one pass, the second attending the
    first's keys and values at every layer (`forward_segments`)."""
    tail_mask = mask[:, split:] != 0
    t = ids.shape[1] - split
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    attention = jnp.concatenate(
        [
            jnp.broadcast_to(mask[:, None, :split] != 0, (ids.shape[0], t, split)),
            causal[None] & tail_mask[:, None, :],
        ],
        axis=2,
    )
    positions = mask[:, :split].sum(1, keepdims=True) + jnp.cumsum(tail_mask, axis=1) - 1
    head = Segment(ids[:, :split], mask[:, :split])
    tail = Segment(ids[:, split:], tail_mask, positions, attention, prefix=(0,))
    h_head, h_tail = model.forward_segments([head, tail])
    return model.logits(jnp.concatenate([h_head, h_tail], axis=1))


def test_prefix_kv_pass_equals_full_forward(pair, batch):
    """A prompt segment, then the rest attending its keys and values as a prefix, in one scan
    over the layers, reproduces the full forward (1e-5): the scoring passes' prefix sharing.
    A segment with a prefix but no positions, or one attending a later segment, is refused."""
    _, model, _ = pair
    ids, mask = batch
    full = np.asarray(_forward(model, ids, mask))
    split_logits = _prefix_pass(model, ids, mask, 8)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(split_logits)[valid], full[valid], rtol=1e-5, atol=1e-5)
    head = Segment(ids[:, :8], mask[:, :8])
    with pytest.raises(ValueError, match="needs positions_BT and attention_BTS"):
        model.forward_segments([head, Segment(ids[:, 8:], mask[:, 8:], prefix=(0,))])
    with pytest.raises(ValueError, match="only earlier segments"):
        model.forward_segments([Segment(ids[:, 8:], mask[:, 8:], prefix=(1,)), head])


@functools.partial(jax.jit, static_argnums=(3,))
def _decode_paths(model, ids, mask, prefill_len):
    """Last-position logits of each 1-token step after a prefill: scanned stacked layers on a
    `KVCache`, and the decode path (`decode_layers`, adapters merged) on a `LayerKVCache`."""
    b, t = ids.shape
    prompt_ids, prompt_mask = ids[:, :prefill_len], mask[:, :prefill_len]
    _, cache = model.prefill(prompt_ids, prompt_mask, init_cache(model.cfg, b, t))
    cache = cache.repeat(2)
    _, prompt = model.prefill(prompt_ids, prompt_mask, init_cache(model.cfg, b, prefill_len))
    layer_cache = LayerKVCache.from_prompt(prompt, t - prefill_len, model.scans_decode).repeat(2)
    layers = model.decode_layers()
    scanned, unrolled = [], []
    for i in range(prefill_len, t):
        step_ids = jnp.repeat(ids[:, i : i + 1], 2, axis=0)
        one = jnp.ones_like(step_ids)
        h, cache = model.prefill(step_ids, one, cache)
        scanned.append(model.logits(h)[:, 0])
        h, layer_cache = model.decode_step(step_ids, one, layer_cache, layers)
        unrolled.append(model.logits(h)[:, 0])
    return jnp.stack(scanned, 1), jnp.stack(unrolled, 1), layer_cache


@pytest.mark.parametrize("scan_decode", [False, True], ids=["unrolled", "scanned"])
def test_decode_layers_equal_the_scanned_layers_with_lora(pair, batch, scan_decode):
    """The sampler's decode path (decode-layout [in, out] weights with LoRA folded in, a
    [B, K, H, S] / [B, K, S, H] cache whose prompt part is shared by each prompt's G = 2 rows),
    unrolled over per-layer arrays or scanned over stacked ones, gives the training model's
    logits on a repeated cache, adapters unmerged (1e-5)."""
    _, base, _ = pair
    layout = Layout(decode_loop="scan" if scan_decode else "unroll")
    cfg = dataclasses.replace(base.cfg, lora=LoRAConfig(rank=4, alpha=8.0), layout=layout)
    model = random_model(cfg, seed=3, std=0.1)
    lora = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(0)
    nnx.update(
        model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), lora)
    )
    ids, mask = batch
    scanned, unrolled, layer_cache = _decode_paths(model, ids, mask, 8)
    assert float(jnp.max(jnp.abs(scanned))) > 0.1
    np.testing.assert_allclose(np.asarray(unrolled), np.asarray(scanned), rtol=1e-5, atol=1e-5)
    assert layer_cache.stacked == scan_decode
    assert len(layer_cache.k) == cfg.num_layers
    b, t = ids.shape
    kh, h = cfg.num_kv_heads, cfg.head_dim
    assert layer_cache.k[0].shape == (2 * b, kh, h, t - 8)  # keys [R, K, H, S]
    assert layer_cache.v[0].shape == (2 * b, kh, t - 8, h)
    assert layer_cache.prompt_k[0].shape == (b, kh, h, 8)  # the prompt stored once per row b
    assert layer_cache.prompt_v[0].shape == (b, kh, 8, h)
    assert int(layer_cache.index) == t - 8


def test_hf_tensors_round_trip(pair):
    _, model, sd = pair
    out = hf_tensors(model)
    tied = model.cfg.tie_embeddings
    assert set(out) == set(sd) - ({"lm_head.weight"} if tied else set())
    for name, value in out.items():
        np.testing.assert_array_equal(value, sd[name], err_msg=name)


def test_hf_config_round_trip(pair):
    tm, model, _ = pair
    hf = model.cfg.to_hf_config()
    assert ModelConfig.from_hf_config(hf) == model.cfg
    reloaded = transformers.AutoConfig.for_model(**hf)
    assert type(reloaded) is type(tm.config)
    assert ModelConfig.from_hf_config(reloaded.to_dict()) == model.cfg


def _tiny_cfg(**kw):
    return ModelConfig(
        arch="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, **kw,
    )  # fmt: skip


def test_missing_tensor_is_named():
    model = random_model(_tiny_cfg())
    tensors = hf_tensors(model)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_hf_tensors(model, tensors.__getitem__)


def test_misshaped_tensor_names_expected_and_found_shapes():
    model = random_model(_tiny_cfg())
    tensors = hf_tensors(model)
    tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 32), np.float32)
    with pytest.raises(ValueError, match=r"down_proj\.weight.*\(64, 32\).*expected \(32, 64\)"):
        load_hf_tensors(model, tensors.__getitem__)


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match=r"gpt2.*llama, qwen2, qwen3"):
        ModelConfig.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_remat_and_bfloat16():
    """Remat changes memory, not math (grads within 1e-5); bf16 params+compute stay close."""
    cfg = _tiny_cfg()
    model = random_model(cfg)
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 128
    graphdef, state = nnx.split(model)

    @jax.jit
    def grads(state):
        def loss(state, remat):
            m = nnx.merge(graphdef, state)
            m.cfg = m.cfg.replace(remat=remat)
            return jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])

        logits = nnx.merge(graphdef, state)(ids)
        return jax.grad(loss)(state, False), jax.grad(loss)(state, True), logits

    g0, g1, logits = grads(state)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    bf = random_model(cfg.replace(param_dtype="bfloat16", dtype="bfloat16"))
    assert bf.layers.attn.q.kernel[...].dtype == jnp.bfloat16
    logits_bf = _forward(bf, ids, jnp.ones_like(ids))
    assert logits_bf.dtype == jnp.float32
    # Same seed, so the bf16 weights are the f32 ones rounded; 8-bit mantissas bound the drift.
    np.testing.assert_allclose(np.asarray(logits_bf), np.asarray(logits), atol=2e-2)


def _dots(jaxpr) -> int:
    """dot_general equations of a jaxpr, counted into every sub-jaxpr (scan, remat bodies)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _dots(sub)
    return n


@pytest.mark.parametrize("lora", [None, LoRAConfig(rank=4, alpha=8.0)], ids=["full", "lora"])
def test_remat_keeping_projections_recomputes_only_the_attention_core(lora):
    """remat_policy="projections" changes what the backward pass recomputes, not the math:
    gradients equal those without remat (float32, 1e-5). Its gradient program has the
    projections' matmuls once, where full remat has them twice: per layer, the recomputed
    forward drops the projections, keeping the two attention dots (and LoRA's x @ A)."""
    cfg = _tiny_cfg(lora=lora)
    model = random_model(cfg)
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 5 % 128
    graphdef, state = nnx.split(model)
    trainable = nnx.LoRAParam if lora else nnx.Param

    def grad_fn(**layout):
        def loss(params, rest):
            m = nnx.merge(graphdef, params, rest)
            m.cfg = m.cfg.replace(**layout)
            return jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])

        params, rest = state.split(trainable, ...)
        return jax.jit(jax.grad(loss)), (params, rest)

    plain, args = grad_fn(remat=False)
    kept, _ = grad_fn(remat=True, remat_policy="projections")
    full, _ = grad_fn(remat=True, remat_policy="full")
    want = plain(*args)
    for g, w in zip(jax.tree.leaves(kept(*args)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    dots = {name: _dots(jax.make_jaxpr(f)(*args).jaxpr) for name, f in
            (("plain", plain), ("kept", kept), ("full", full))}  # fmt: skip
    # Recomputed per layer body: with the projections kept, the attention scores and weighted
    # sum, and with LoRA each adapter's rank-R product x @ A (its B's gradient needs it);
    # with full remat also at least the q, k, v and gate/up projections.
    kept_extra = dots["kept"] - dots["plain"]
    assert kept_extra <= 2 + (len(lora.targets) if lora else 0), dots
    assert dots["full"] - dots["plain"] >= kept_extra + 4, dots


def test_unrolled_layers_equal_the_scan():
    """`layer_loop="unroll"` changes the program, not the math: logits, gradients and a cached
    prefill + decode step equal the scanned layers' (float32, 1e-5)."""
    cfg = _tiny_cfg().replace(num_layers=3)
    model = random_model(cfg)
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 7 % 128
    mask = jnp.ones_like(ids).at[1, :3].set(0)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def run(state, unroll):
        def loss(state):
            m = nnx.merge(graphdef, state)
            m.cfg = m.cfg.replace(layout=Layout(layer_loop="unroll" if unroll else "scan"))
            logits = m(ids, attention_mask=mask)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5]), logits

        grads, logits = jax.grad(loss, has_aux=True)(state)
        m = nnx.merge(graphdef, state)
        m.cfg = m.cfg.replace(layout=Layout(layer_loop="unroll" if unroll else "scan"))
        cache = init_cache(cfg, 2, 9)
        _, cache = m.prefill(ids, mask, cache)
        h, _ = m.prefill(ids[:, :1], jnp.ones_like(ids[:, :1]), cache)
        return grads, logits, m.logits(h)

    assert "while" in run.lower(state, False).as_text()
    assert "while" not in run.lower(state, True).as_text()
    scanned, unrolled = run(state, False), run(state, True)
    assert float(jnp.max(jnp.abs(scanned[2]))) > 0.1
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def _compile_seconds(num_layers):
    cfg = ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    fn = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i, attention_mask=jnp.ones_like(i)))
    start = time.perf_counter()
    fn.lower(state, ids).compile()
    return time.perf_counter() - start


def test_compile_time_does_not_grow_with_depth():
    """Layers are scanned, so 30 layers compile in about the time of 2 (allow 2x for noise)."""
    t2, t30 = _compile_seconds(2), _compile_seconds(30)
    assert t30 < 2.0 * t2 + 0.5, f"compile 2 layers {t2:.2f}s vs 30 layers {t30:.2f}s"
