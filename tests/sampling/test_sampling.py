"""Sampler tests without a real model: the loop over a fake step function, token selection
statistics, and temperature schedules."""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxgrpo import sampling
from jaxgrpo.sampling import LoopConfig, StopReason

V = 16
select = jax.jit(sampling.select_tokens, static_argnames="top_k")


@flax.struct.dataclass
class FakeCache:
    """Records every token fed to the fake model, so tests can check what the loop fed it."""

    tokens_BS: jax.Array
    index: jax.Array
    calls: jax.Array

    def repeat(self, g):
        return self.replace(tokens_BS=jnp.repeat(self.tokens_BS, g, axis=0))


def fake_cache(batch, size):
    return FakeCache(
        jnp.full((batch, size), -1, jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    )


def bigram_step(table_VV, ids_BT, mask_BT, cache):
    """A bigram 'language model': logits of the next token are ``table[last token]``."""
    tokens_BS = jax.lax.dynamic_update_slice(cache.tokens_BS, ids_BT, (0, cache.index))
    cache = FakeCache(tokens_BS, cache.index + ids_BT.shape[1], cache.calls + 1)
    return table_VV[ids_BT[:, -1]], cache


def successor_table(period=V, eos_free=True):
    """Greedy bigram table whose argmax after token t is (t + 1) % period."""
    nxt = (np.arange(V) + 1) % period
    return jnp.asarray(np.eye(V, dtype=np.float32)[nxt] * 10.0)


def run_loop(
    table,
    prompt_ids,
    *,
    t,
    rng=0,
    g=1,
    temperature=0.0,
    top_p=1.0,
    min_p=0.0,
    max_lengths=None,
    eos_ids=(),
    top_k=0,
    rep_n=0,
    rep_k=4,
):
    b, p = prompt_ids.shape
    cfg = LoopConfig(
        max_new_tokens=t, num_samples=g, eos_ids=eos_ids, top_k=top_k, repetition_ngram=rep_n
    )
    knobs = sampling.make_knobs(
        b * g,
        t,
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        max_lengths=max_lengths,
        repetition_count=rep_k,
    )

    @jax.jit
    def go(table, ids, knobs, key):
        mask = jnp.ones_like(ids)
        state = sampling.prefill(
            bigram_step, table, ids, mask, fake_cache(b, p + t), knobs, key, cfg
        )
        return sampling.decode(bigram_step, table, state, knobs, cfg)

    return go(table, jnp.asarray(prompt_ids, jnp.int32), knobs, jax.random.key(rng))


def test_stop_tokens_mask_lengths_and_early_exit():
    """Greedy successor model: prompt ending in s emits s+1, s+2, ...; eos ids 9 and 12.

    Row 0 ends in 5 -> 6 7 8 9 (stops at 9, length 4); row 1 ends in 10 -> 11 12 (length 2);
    row 2 ends in 0 -> 1 .. 9 (length 9). T = 12, so the loop exits after step 9 < T.
    """
    prompts = np.array([[3, 4, 5], [1, 2, 10], [7, 7, 0]])
    s = run_loop(successor_table(), prompts, t=12, eos_ids=(9, 12))
    np.testing.assert_array_equal(s.lengths_R, [4, 2, 9])
    np.testing.assert_array_equal(s.stop_reason_R, [StopReason.STOP_TOKEN] * 3)
    np.testing.assert_array_equal(s.tokens_RT[0, :5], [6, 7, 8, 9, 0])
    np.testing.assert_array_equal(s.tokens_RT[1, :3], [11, 12, 0])
    np.testing.assert_array_equal(s.mask_RT.sum(1), s.lengths_R)
    assert s.mask_RT[0, 3] == 1 and s.mask_RT[0, 4] == 0, "mask must include the stop token"
    assert int(s.step) == 9, "loop must exit once every row stopped"
    assert int(s.cache.calls) == 9, "one prefill call plus one call per decoded step after it"
    # The model was fed the prompt then each generated token (all but the last).
    np.testing.assert_array_equal(s.cache.tokens_BS[2, :12], [7, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8, -1])
    assert np.all(np.asarray(s.logprobs_RT)[np.asarray(s.mask_RT) == 0] == 0.0)


def test_max_length_and_per_row_length():
    """No eos: every row runs to its own cap (default T) and reports LENGTH."""
    prompts = np.array([[1], [2], [3]])
    s = run_loop(successor_table(), prompts, t=6, max_lengths=np.array([2, 6, 4]))
    np.testing.assert_array_equal(s.lengths_R, [2, 6, 4])
    np.testing.assert_array_equal(s.stop_reason_R, [StopReason.LENGTH] * 3)
    np.testing.assert_array_equal(s.tokens_RT[0], [2, 3, 0, 0, 0, 0])
    assert int(s.step) == 6


def test_repetition_guard():
    """Successor modulo 3 loops 0 1 2 0 1 2 ...: with blocks up to n=4 and k=3 repeats the tail
    first is three copies of a 3-block after 9 tokens (6 = 3 * (3 - 1) matches of t[i] == t[i-3]).
    Modulo 16 never repeats within T, so that row runs to length."""
    prompts = np.array([[2], [2]])
    looping = run_loop(successor_table(period=3), prompts[:1], t=16, rep_n=4, rep_k=3)
    assert int(looping.lengths_R[0]) == 9
    assert int(looping.stop_reason_R[0]) == StopReason.REPETITION
    plain = run_loop(successor_table(), prompts[1:], t=16, rep_n=4, rep_k=3)
    assert int(plain.stop_reason_R[0]) == StopReason.LENGTH and int(plain.lengths_R[0]) == 16
    off = run_loop(successor_table(period=3), prompts[:1], t=16)
    assert int(off.lengths_R[0]) == 16, "the guard is off by default"


def test_groups_prefill_once_and_rows_grouped():
    """G samples per prompt: rows b*G..b*G+G-1 continue prompt b; the prompt is fed once."""
    prompts = np.array([[1, 2], [5, 6]])
    s = run_loop(successor_table(), prompts, t=3, g=3)
    np.testing.assert_array_equal(s.tokens_RT[:, 0], [3, 3, 3, 7, 7, 7])
    np.testing.assert_array_equal(s.cache.tokens_BS[4, :4], [5, 6, 7, 8])
    assert int(s.cache.calls) == 3


def test_per_position_temperature_and_logprobs():
    """Temperature 0 positions are greedy; logprobs are log_softmax(table[prev] / T_t)."""
    table = jax.random.normal(jax.random.key(1), (V, V)) * 2.0
    temp_T = jnp.array([0.0, 1.5, 0.0, 0.5, 0.7, 0.0])
    prompts = np.arange(8)[:, None]
    s = run_loop(table, prompts, t=6, temperature=temp_T, rng=3)
    toks = np.asarray(s.tokens_RT)
    prev = np.concatenate([prompts, toks[:, :-1]], axis=1)
    logits = np.asarray(table)[prev]  # [N, T, V]
    greedy_pos = np.asarray(temp_T) == 0
    np.testing.assert_array_equal(toks[:, greedy_pos], logits.argmax(-1)[:, greedy_pos])
    safe_t = np.where(greedy_pos, 1.0, np.asarray(temp_T))[None, :, None]
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits / safe_t), axis=-1))
    ref_tok = np.take_along_axis(ref, toks[..., None], -1)[..., 0]
    np.testing.assert_allclose(s.logprobs_RT, ref_tok, rtol=1e-5, atol=1e-5)
    assert not np.all(toks[:, 1] == logits[:, 1].argmax(-1)), "T=1.5 should not be greedy"


def _first_tokens(logits_V, n, **kw):
    logits_RV = jnp.broadcast_to(logits_V, (n, logits_V.shape[0]))
    temp = kw.pop("temperature", 1.0)
    tok, lp = select(
        jax.random.key(kw.pop("seed", 0)),
        logits_RV,
        jnp.full((n,), temp),
        jnp.asarray(kw.pop("top_p", 1.0)),
        jnp.asarray(kw.pop("min_p", 0.0)),
        top_k=kw.pop("top_k", 0),
    )
    return np.asarray(tok), np.asarray(lp)


def test_first_token_frequencies_chi_square():
    """20k draws at T=0.7 match softmax(logits / T): chi-square p-value > 1e-3 (fixed seed)."""
    logits = jax.random.normal(jax.random.key(0), (V,))
    n, temp = 20000, 0.7
    tok, _ = _first_tokens(logits, n, temperature=temp)
    probs = np.asarray(jax.nn.softmax(logits / temp), np.float64)
    probs /= probs.sum()
    counts = np.bincount(tok, minlength=V)
    _, pvalue = stats.chisquare(counts, probs * n)
    assert pvalue > 1e-3, f"frequencies differ from softmax(logits/T): p={pvalue}"
    # And the test can fail: T=1 frequencies are rejected against the T=0.7 distribution.
    tok1, _ = _first_tokens(logits, n, temperature=1.0)
    _, p_wrong = stats.chisquare(np.bincount(tok1, minlength=V), probs * n)
    assert p_wrong < 1e-6


def test_two_level_categorical_chi_square():
    """The blocked sampler used for large vocabularies (V=1000 > 4 blocks of 256, padded) draws
    from softmax(x): 12 likely tokens spread over the blocks plus an 'everything else' bin,
    chi-square p-value > 1e-3 over 20k draws with a fixed seed."""
    v, n = 1000, 20000
    hot = np.array([3, 70, 255, 256, 400, 511, 600, 777, 800, 950, 998, 999])
    x = np.full(v, -6.0, np.float32)
    x[hot] = np.asarray(jax.random.normal(jax.random.key(7), (hot.size,)))
    x_nv = jnp.broadcast_to(jnp.asarray(x), (n, v))
    tok = np.asarray(jax.jit(sampling.select.categorical)(jax.random.key(8), x_nv))
    probs = np.exp(x - x.max()).astype(np.float64)
    probs /= probs.sum()
    counts = np.bincount(tok, minlength=v)
    obs = np.append(counts[hot], n - counts[hot].sum())
    exp = np.append(probs[hot], 1 - probs[hot].sum()) * n
    _, pvalue = stats.chisquare(obs, exp * (obs.sum() / exp.sum()))
    assert pvalue > 1e-3, f"blocked categorical is biased: p={pvalue}"
    assert tok.max() < v, "padding slots must never be drawn"


def test_top_k1_is_greedy_and_top_p_stays_in_nucleus():
    logits_RV = jax.random.normal(jax.random.key(2), (64, V)) * 2.0
    n = logits_RV.shape[0]
    tok, lp = select(
        jax.random.key(5),
        logits_RV,
        jnp.full((n,), 1.3),
        jnp.asarray(1.0),
        jnp.asarray(0.0),
        top_k=1,
    )
    np.testing.assert_array_equal(tok, np.asarray(logits_RV).argmax(-1))
    ref = jax.nn.log_softmax(logits_RV / 1.3)[jnp.arange(n), tok]
    np.testing.assert_allclose(lp, ref, rtol=1e-6, atol=1e-6)

    top_p, temp = 0.6, 1.2
    probs = np.asarray(jax.nn.softmax(logits_RV / temp))
    order = np.argsort(-probs, axis=1)
    sorted_p = np.take_along_axis(probs, order, 1)
    seen_outside_top1 = False
    for seed in range(20):
        tok, _ = select(
            jax.random.key(seed),
            logits_RV,
            jnp.full((n,), temp),
            jnp.asarray(top_p),
            jnp.asarray(0.0),
            top_k=0,
        )
        tok = np.asarray(tok)
        rank = np.argmax(order == tok[:, None], axis=1)
        mass_before = np.take_along_axis(np.cumsum(sorted_p, 1) - sorted_p, rank[:, None], 1)
        assert np.all(mass_before[:, 0] < top_p), "sampled a token outside the nucleus"
        seen_outside_top1 |= bool(np.any(rank > 0))
    assert seen_outside_top1, "top_p=0.6 should still sample beyond the argmax sometimes"


def test_min_p_floor():
    logits = jax.random.normal(jax.random.key(4), (V,)) * 2.0
    tok, _ = _first_tokens(logits, 4000, temperature=1.0, min_p=0.2)
    probs = np.asarray(jax.nn.softmax(logits))
    assert np.all(probs[tok] >= 0.2 * probs.max() * (1 - 1e-6))
    assert len(np.unique(tok)) > 1


def test_schedules():
    """Endpoints and midpoints derived from each formula; position multiplier applied."""
    lin = sampling.linear(1.0, 0.5, steps=10)
    np.testing.assert_allclose([lin(0), lin(5), lin(10), lin(20)], [1.0, 0.75, 0.5, 0.5])
    cos = sampling.cosine(1.0, 0.0, steps=4)
    np.testing.assert_allclose([cos(0), cos(2), cos(4)], [1.0, 0.5, 0.0], atol=1e-6)
    exp = sampling.exponential(1.0, 0.25, steps=2)
    np.testing.assert_allclose([exp(0), exp(1), exp(2)], [1.0, 0.5, 0.25], rtol=1e-6)
    pw = sampling.piecewise([2, 4], [1.0, 0.8, 0.6])
    np.testing.assert_allclose(pw(jnp.arange(6)), [1.0, 1.0, 0.8, 0.8, 0.6, 0.6])
    np.testing.assert_allclose(sampling.constant(0.9)(3), 0.9)
    temp_T = sampling.temperatures(5, 6, lin, position_schedule=pw)
    np.testing.assert_allclose(temp_T, 0.75 * np.array([1.0, 1.0, 0.8, 0.8, 0.6, 0.6]), rtol=1e-6)
    traced = jax.jit(lambda s: sampling.temperatures(s, 4, lin))(jnp.asarray(10))
    np.testing.assert_allclose(traced, [0.5] * 4)
    with pytest.raises(ValueError, match="unknown temperature schedule"):
        sampling.make_schedule("warmup")
    with pytest.raises(ValueError, match="len\\(values\\)"):
        sampling.piecewise([1], [1.0])


# ---------------------------------------------------------------- the real Transformer (tiny)


@pytest.fixture(scope="module")
def tiny():
    from flax import nnx

    from jaxgrpo.models.config import ModelConfig
    from jaxgrpo.models.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    ids = np.array([[0, 0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 0, 9, 4]])
    mask = (ids != 0).astype(np.int32)
    return model, ids, mask


def test_logprobs_and_cached_decode_match_full_forward(tiny):
    """Greedy and sampled positions (per-position temperature) from the cached decode agree with
    one full forward over prompt + completion: greedy tokens are the argmax of the full logits
    and logprobs equal log_softmax(logits / T_t) at the sampled tokens (float32, 1e-4)."""
    model, ids, mask = tiny
    t, g = 8, 2
    temp_T = jnp.array([0.0, 1.0, 0.0, 0.8, 1.2, 0.0, 1.0, 0.6])
    out = sampling.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(1),
        max_new_tokens=t,
        temperature=temp_T,
        num_samples=g,
        eos_ids=(3,),
    )
    full_ids = np.concatenate([np.repeat(ids, g, 0), np.asarray(out.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, g, 0), np.asarray(out.mask)], 1)
    logits = np.asarray(model(jnp.asarray(full_ids), attention_mask=jnp.asarray(full_mask)))
    p = ids.shape[1]
    pred = logits[:, p - 1 : p + t - 1]  # logits predicting completion position 0..T-1
    m = np.asarray(out.mask).astype(bool)
    greedy = np.broadcast_to(np.asarray(temp_T) == 0, m.shape) & m
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy], pred.argmax(-1)[greedy])
    safe_t = np.where(np.asarray(temp_T) == 0, 1.0, np.asarray(temp_T))[None, :, None]
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(pred / safe_t), axis=-1))
    ref_tok = np.take_along_axis(ref, np.asarray(out.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], ref_tok[m], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.temperatures, np.broadcast_to(temp_T, m.shape))
    assert m.sum() > 10


@pytest.mark.parametrize("compact_rows", [0, (8, 2)])
def test_growing_cache_equals_the_full_forward_and_the_fixed_cache(tiny, compact_rows):
    """A completion cache grown through sizes 3, 5, 8 and 10 (the first loop reads only the
    slots of its current size) gives the tokens of a 10-slot cache from the start, and log-probs
    equal to one full forward over prompt + completion within 1e-5 (float32), with and without
    row compaction."""
    model, ids, mask = tiny
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # B = 4
    t, g = 10, 4
    max_len = np.full(16, t)
    max_len[[0, 5, 9]] = [2, 4, 7]  # some rows stop inside the first sizes
    kw = dict(
        rng=jax.random.key(2), max_new_tokens=t, temperature=1.0, num_samples=g,
        max_lengths=max_len, compact_rows=compact_rows,
    )  # fmt: skip
    fixed = sampling.generate(model, ids, mask, cache_sizes=(), **kw)
    grown = sampling.generate(model, ids, mask, cache_sizes=(3, 5, 8, t), **kw)
    for name in ("tokens", "mask", "lengths", "stop_reason", "steps"):
        np.testing.assert_array_equal(getattr(grown, name), getattr(fixed, name), err_msg=name)
    np.testing.assert_allclose(grown.logprobs, fixed.logprobs, rtol=1e-5, atol=1e-5)
    full_ids = np.concatenate([np.repeat(ids, g, 0), np.asarray(grown.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, g, 0), np.asarray(grown.mask)], 1)
    logits = np.asarray(model(jnp.asarray(full_ids), attention_mask=jnp.asarray(full_mask)))
    p = ids.shape[1]
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:, p - 1 : p + t - 1]), axis=-1))
    ref_tok = np.take_along_axis(ref, np.asarray(grown.tokens)[..., None], -1)[..., 0]
    m = np.asarray(grown.mask).astype(bool)
    assert m[:, 8:].any(), "no row reached the last cache size"
    np.testing.assert_allclose(np.asarray(grown.logprobs)[m], ref_tok[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_sizes", [(), None])
def test_the_completion_cache_is_made_and_dropped_inside_decode(tiny, cache_sizes):
    """The prefill program hands decode the prompt cache with no completion slots, and decode
    returns no cache: as either program's output, the completion cache would stay allocated
    beside the decode loop's own for the whole decode program."""
    from flax import nnx

    from jaxgrpo.sampling.generate import sampler_programs

    model, ids, mask = tiny
    graphdef, state = nnx.split(model)
    settings = sampling.SamplerSettings(
        max_new_tokens=6, num_samples=2, temperature=1.0, cache_sizes=cache_sizes
    )
    prefill, decode, knobs = sampler_programs(graphdef, model.cfg, ids, settings)
    ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    prompted = prefill((state,), ids, mask, knobs, jax.random.key(0))
    assert {x.shape[-1] for x in jax.tree.leaves(prompted.cache.k)} == {0}
    assert {x.shape[-2] for x in jax.tree.leaves(prompted.cache.v)} == {0}
    assert prompted.cache.mask.shape == (2 * ids.shape[0], 0)
    assert {x.shape[-1] for x in jax.tree.leaves(prompted.cache.prompt_k)} == {ids.shape[1]}
    done = decode((state,), prompted, knobs)
    assert done.cache is None and int(done.step) == 6


def test_cache_sizes_default_and_checks():
    """Completions of at most CACHE_STEP tokens keep one size; longer ones grow by CACHE_STEP;
    sizes must increase and end at T; a cache never shrinks."""
    from jaxgrpo.models.kv_cache import KVCache, LayerKVCache
    from jaxgrpo.sampling.generate import CACHE_STEP, auto_cache_sizes

    assert auto_cache_sizes(CACHE_STEP) == ()
    assert auto_cache_sizes(4 * CACHE_STEP) == tuple(CACHE_STEP * i for i in (1, 2, 3, 4))
    assert auto_cache_sizes(2 * CACHE_STEP + 3)[-2:] == (2 * CACHE_STEP, 2 * CACHE_STEP + 3)
    for bad in ((4, 4, 8), (8, 4), (4, 6)):
        with pytest.raises(ValueError, match="cache_sizes"):
            LoopConfig(max_new_tokens=8, cache_sizes=bad)
    z = jnp.zeros((1, 2, 3, 2, 4))  # [L, B, P, K, H]
    prompt = KVCache(z, z, jnp.ones((2, 3), bool), jnp.zeros(2, jnp.int32), jnp.int32(3))
    cache = LayerKVCache.from_prompt(prompt, 5)
    grown = cache.grow(8)
    assert grown.k[0].shape == (2, 2, 4, 8) and grown.v[0].shape == (2, 2, 8, 4)
    assert grown.mask.shape == (2, 8)
    with pytest.raises(ValueError, match="cannot grow"):
        grown.grow(6)


def test_no_recompilation_when_knobs_change(tiny):
    """Temperature (scalar, [T], schedule), top-p, min-p, per-row lengths and the key are traced:
    one prefill + one decode program per bucket; a new prompt bucket adds exactly two."""
    model, ids, mask = tiny
    kw = dict(max_new_tokens=4, num_samples=2, eos_ids=(3,))
    sampling.generate(model, ids, mask, rng=jax.random.key(0), temperature=1.0, **kw)
    before = sampling.compiled_programs()
    for i, (temp, top_p, min_p) in enumerate(
        [(0.7, 0.9, 0.0), (jnp.linspace(1.0, 0.0, 4), 1.0, 0.1), (0.0, 0.5, 0.05)]
    ):
        sampling.generate(
            model,
            ids,
            mask,
            rng=jax.random.key(i),
            temperature=temp,
            top_p=top_p,
            min_p=min_p,
            max_lengths=np.array([1, 2, 4]),
            **kw,
        )
    sampling.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(0),
        temperature=sampling.temperatures(3, 4, sampling.linear(1.0, 0.5, 10)),
        **kw,
    )
    assert sampling.compiled_programs() == before, "changing traced knobs recompiled"
    wide = np.pad(ids, ((0, 0), (8, 0)))
    sampling.generate(model, wide, (wide != 0).astype(np.int32), rng=jax.random.key(0), **kw)
    assert sampling.compiled_programs() == before + 2, "a new bucket compiles prefill + decode"


def _on_eight_devices(model, cfg, ids, mask, shape=None, rules=None):
    """``model``'s weights on a mesh of 8 devices (default 2x2x2) under ``rules`` (default the
    sampling rules), as a model of ``cfg``, and the batch rows over (data, fsdp)."""
    from flax import nnx

    from jaxgrpo.core import sharding as shd
    from jaxgrpo.models.construct import random_model

    mesh = shd.make_mesh(shape or {"data": 2, "fsdp": 2, "tensor": 2})
    sharded = random_model(cfg, mesh=mesh, rules=rules or shd.SAMPLE_RULES)
    place = lambda x, y: jax.device_put(x, y.sharding)  # noqa: E731
    nnx.update(sharded, jax.tree.map(place, nnx.state(model), nnx.state(sharded)))
    rows = shd.batch_sharding(mesh, ids.shape[0], 2)
    return sharded, jax.device_put(ids, rows), jax.device_put(mask, rows)


def test_sharded_8_devices_equals_one(tiny):
    """Batch over (data, fsdp) and heads over tensor on a 2x2x2 mesh of 8 virtual devices give
    the same tokens and logprobs (1e-5) as one device."""
    model, ids, mask = tiny
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # B = 4
    sharded, *placed = _on_eight_devices(model, model.cfg, ids, mask)
    kw = dict(rng=jax.random.key(2), max_new_tokens=6, temperature=1.0, num_samples=2, eos_ids=(3,))
    one = sampling.generate(model, ids, mask, **kw)
    eight = sampling.generate(sharded, *placed, **kw)
    assert len(eight.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(eight.tokens, one.tokens)
    np.testing.assert_allclose(eight.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_over_fsdp_sampling_equals_one_device(tiny, monkeypatch):
    """Trained weights fsdp-sharded on a 4x2x1 mesh, resharded for decoding by
    ``SAMPLE_TP_RULES`` (heads, MLP and vocabulary over fsdp, rows over data; what an 8B model
    gets on v5e-8), give one device's tokens, and logprobs within 1e-5, with compaction."""
    from jaxgrpo.core import sharding as shd

    model, ids, mask = tiny
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # B = 4
    shape = {"data": 4, "fsdp": 2, "tensor": 1}
    sharded, *placed = _on_eight_devices(model, model.cfg, ids, mask, shape, shd.TRAIN_RULES)
    picked = []
    choose = lambda mesh, nbytes: picked.append(shd.SAMPLE_TP_RULES) or shd.SAMPLE_TP_RULES  # noqa: E731
    monkeypatch.setattr(shd, "sampling_rules", choose)
    max_len = np.full(16, 3)
    max_len[[1, 6, 11, 12]] = [10, 5, 5, 8]
    kw = dict(
        rng=jax.random.key(4), max_new_tokens=10, temperature=1.0, num_samples=4, eos_ids=(3,),
        max_lengths=max_len, compact_rows=(8,),
    )  # fmt: skip
    one = sampling.generate(model, ids, mask, **kw)
    eight = sampling.generate(sharded, *placed, **kw)
    assert picked, "the sampler did not ask for its layout"
    np.testing.assert_array_equal(eight.tokens, one.tokens)
    np.testing.assert_array_equal(eight.lengths, one.lengths)
    np.testing.assert_allclose(eight.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compact_rows", [4, (8, 2), (4, 2, 1)])
def test_compacting_finished_rows_changes_no_completion(tiny, compact_rows):
    """Decoding only the still-running rows once at most `compact_rows` are left (at each
    level in turn) gives the same tokens, masks and stop reasons, and logprobs within 1e-5,
    as decoding every row to the end (row r draws the same random numbers wherever it sits
    in the batch)."""
    model, ids, mask = tiny
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # B = 4
    max_len = np.full(16, 2)
    # After 2 tokens only 4 of the 16 rows run on, after 5 only rows 1 and 12, after 8 row 1.
    max_len[[1, 6, 11, 12]] = [10, 5, 5, 8]
    kw = dict(
        rng=jax.random.key(5), max_new_tokens=10, temperature=1.0, num_samples=4, eos_ids=(3,),
        max_lengths=max_len,
    )  # fmt: skip
    full = sampling.generate(model, ids, mask, compact_rows=0, **kw)
    compact = sampling.generate(model, ids, mask, compact_rows=compact_rows, **kw)
    assert int(np.asarray(full.lengths).max()) > 2, "the compacted loop decoded nothing"
    for name in ("tokens", "mask", "lengths", "stop_reason", "steps"):
        np.testing.assert_array_equal(getattr(compact, name), getattr(full, name), err_msg=name)
    np.testing.assert_allclose(compact.logprobs, full.logprobs, rtol=1e-5, atol=1e-5)


def test_default_compaction_levels():
    """R / 4 rows then one per device; R / 2 first only for budgets over one cache step (where
    completions spread over hundreds of steps); levels must split over the devices; none when
    no row can stop early or the batch is small."""
    from jaxgrpo.sampling.generate import CACHE_STEP, auto_compact_rows

    assert auto_compact_rows(32, True, 1, CACHE_STEP) == (8, 1)
    assert auto_compact_rows(32, True, 1, CACHE_STEP + 1) == (16, 8, 1)
    assert auto_compact_rows(32, True, 8, 512) == (16, 8)
    assert auto_compact_rows(64, True, 16, 512) == (32, 16)
    assert auto_compact_rows(32, False, 1, 512) == () and auto_compact_rows(8, True, 1, 512) == ()


def test_categorical_row_draws_do_not_depend_on_the_batch():
    """Row r of a batch draws the same token whether sampled with all rows or a subset."""
    x_nv = jax.random.normal(jax.random.key(3), (6, 3000))
    rows = jnp.array([1, 4, 5])
    rng = jax.random.key(9)
    whole = sampling.select.categorical(rng, x_nv)
    part = sampling.select.categorical(rng, x_nv[rows], rows, 6)
    np.testing.assert_array_equal(part, np.asarray(whole)[np.asarray(rows)])
    assert len(set(np.asarray(whole).tolist())) > 1


def test_scanned_decode_equals_unrolled(tiny):
    """The decode loop as a scan over stacked layers and cache (what TPUs and GPUs run) gives
    the unrolled loop's tokens, and logprobs within 1e-5, with row compaction at two levels
    and a growing cache, on one device and on a 2x2x2 mesh under the sampling rules."""
    from flax import nnx

    from jaxgrpo.models.layout import Layout
    from jaxgrpo.models.transformer import Transformer

    tiny_model, ids, mask = tiny
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # B = 4

    def with_decode_loop(loop):
        cfg = tiny_model.cfg.replace(layout=Layout(decode_loop=loop))
        model = Transformer(cfg, rngs=nnx.Rngs(1))
        nnx.update(model, nnx.state(tiny_model))
        return model

    model, scanned = with_decode_loop("unroll"), with_decode_loop("scan")
    assert scanned.scans_decode and not model.scans_decode
    max_len = np.full(16, 3)
    max_len[[1, 6, 11, 12]] = [10, 5, 5, 8]
    kw = dict(
        rng=jax.random.key(5), max_new_tokens=10, temperature=1.0, num_samples=4, eos_ids=(3,),
        max_lengths=max_len, compact_rows=(8, 2), cache_sizes=(4, 7, 10),
    )  # fmt: skip
    unrolled = sampling.generate(model, ids, mask, **kw)
    sharded, *placed = _on_eight_devices(model, scanned.cfg, ids, mask)
    assert int(np.asarray(unrolled.lengths).max()) > 3, "the compacted loop decoded nothing"
    for out in (
        sampling.generate(scanned, ids, mask, **kw),
        sampling.generate(sharded, *placed, **kw),
    ):
        for name in ("tokens", "mask", "lengths", "stop_reason", "steps"):
            np.testing.assert_array_equal(getattr(out, name), getattr(unrolled, name), err_msg=name)
        np.testing.assert_allclose(out.logprobs, unrolled.logprobs, rtol=1e-5, atol=1e-5)
