"""Scoring of sampled completions: chunked logits, temperatures, and prefix sharing.

The reference for every value is the plain forward `model(ids, attention_mask=mask)` over the
whole (prompt + completion) row, log-softmaxed at the sampled tokens: nothing of
`jaxgrpo.models.logprobs` is reused to build it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models import lm_head
from jaxgrpo.models import logprobs as lp
from jaxgrpo.models.config import LoRAConfig
from jaxgrpo.models.layout import Layout
from jaxgrpo.models.packing import pack
from jaxgrpo.models.tiny import tiny_model_config
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.rl.rollout import split_common_prefix

B, G, P, T = 2, 3, 8, 6
ATOL = 1e-5  # float32; the shared and unshared paths sum the same terms in another order


def _model(lora: bool) -> Transformer:
    cfg = tiny_model_config(LoRAConfig(rank=4, alpha=8.0) if lora else None)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if lora:
        # B starts at zero; give the adapters weight so their gradients are not trivially equal.
        _, lora_state = nnx.split(model, nnx.LoRAParam, ...)[:2]
        keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(lora_state)))
        leaves, treedef = jax.tree.flatten(lora_state)
        noisy = [
            0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
        ]
        nnx.update(model, jax.tree.unflatten(treedef, noisy))
    return model


def _batch():
    """Left-padded prompts of different lengths, ragged completions, mixed temperatures."""
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, 300, (B, P)).astype(np.int32)
    prompt_mask = np.ones((B, P), np.int32)
    prompt_mask[0, :3] = 0  # prompt 0 has 5 tokens, prompt 1 has 8
    prompt_ids[0, :3] = 0
    tokens = rng.integers(3, 300, (B * G, T)).astype(np.int32)
    mask = np.ones((B * G, T), np.int32)
    mask[1, 4:] = 0
    mask[4, 1:] = 0
    temps = np.full((B * G, T), 0.7, np.float32)
    temps[2] = 1.3
    temps[5, :2] = 0.0  # greedy positions are scored at temperature 1
    return prompt_ids, prompt_mask, tokens, mask, temps


def _reference(model, prompt_ids, prompt_mask, tokens, mask, temps):
    """log softmax(logits / temp) at each completion token, from one plain forward pass."""
    ids = jnp.concatenate([jnp.repeat(prompt_ids, G, 0), tokens], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(prompt_mask, G, 0), mask], axis=1)
    logits = model(ids, attention_mask=full_mask)[:, P - 1 : P + T - 1]
    temps = jnp.where(temps > 0, temps, 1.0)
    logp_all = jax.nn.log_softmax(logits / temps[..., None], axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def _packing(batch):
    return jax.tree.map(jnp.asarray, pack(batch[3].sum(axis=1), G, T))


def _shared(model, *batch, chunk_size=4, packed=False):
    packing = _packing(batch) if packed else None
    return lp.shared_prefix_logprobs(
        model, *batch, group_size=G, chunk_size=chunk_size, packing=packing
    )


class _Head:
    """The two things `head_token_logprobs` reads from a model: the head weight and dtype."""

    cfg = type("Cfg", (), {"dtype": "float32", "layout": Layout()})

    def __init__(self, w_VD):
        self.w_VD = w_VD

    def head_weight(self):
        return self.w_VD


def _head_case(seed):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(3, 7, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(11, 5)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 11, (3, 7)), jnp.int32)
    temps = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 2.0], (3, 7)), jnp.float32)
    return rng, h, w, tokens, temps


def _plain_stats(h, w, tokens, temps):
    """log softmax(h @ w.T / temp) at the tokens, and the entropy, by plain autodiff-able ops."""
    logp_all = jax.nn.log_softmax((h @ w.T) / jnp.where(temps > 0, temps, 1.0)[..., None], -1)
    logp = jnp.take_along_axis(logp_all, tokens[..., None], -1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, -1)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_head_token_logprobs_any_chunk_size(chunk_size):
    """Chunking over T (with padding when C does not divide T) changes nothing."""
    _, h, w, tokens, temps = _head_case(2)
    logp, ent = lm_head.head_token_logprobs(_Head(w), h, tokens, temps, chunk_size)
    want_logp, want_ent = _plain_stats(h, w, tokens, temps)
    np.testing.assert_allclose(logp, want_logp, atol=1e-6)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


HEAD_GRADS = pytest.mark.parametrize(
    "wrt, entropy_grad",
    [((0, 1), True), ((0,), True), ((0,), False)],
    ids=["head-trained", "head-frozen", "head-frozen-no-entropy-grad"],
)


@HEAD_GRADS
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_head_vjp_equals_autodiff(keep, wrt, entropy_grad, monkeypatch):
    """The hand-written backward of the LM-head statistics equals autodiff of the plain ones:
    with the head trained or frozen (LoRA), the entropy differentiated or not (no entropy
    bonus), the [N, T, V] log-probabilities kept from the forward pass or recomputed."""
    monkeypatch.setattr(
        lm_head, "KEEP_LOG_PROBS_BYTES", lm_head.KEEP_LOG_PROBS_BYTES if keep else 0
    )
    rng, h, w, tokens, temps = _head_case(3)
    a, c = (jnp.asarray(rng.normal(size=(3, 7)), jnp.float32) for _ in range(2))

    def objective(h, w, custom):
        if custom:
            logp, ent = lm_head.head_token_logprobs(_Head(w), h, tokens, temps, chunk_size=4)
        else:
            logp, ent = _plain_stats(h, w, tokens, temps)
        return jnp.sum(a * logp + (c * ent if entropy_grad else 0.0)), (logp, ent)

    (_, want), want_g = jax.value_and_grad(objective, wrt, has_aux=True)(h, w, False)
    (_, got), got_g = jax.value_and_grad(objective, wrt, has_aux=True)(h, w, True)
    for x, y in zip(got + got_g, want + want_g, strict=True):
        assert float(jnp.abs(y).max()) > 1e-3
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "wrt, entropy_grad, matmuls",
    [((0, 1), True, 4), ((0,), False, 2)],
    ids=["head-trained", "head-frozen-no-entropy-grad"],
)
def test_head_matmuls_per_update(wrt, entropy_grad, matmuls, monkeypatch):
    """The update's vocabulary-sized matmuls: with a trained head the logits, their
    recomputation, the gradient through the head and the head's own; with a frozen head whose
    entropy is not differentiated (LoRA without an entropy bonus) only the logits and, in the
    same forward pass, the log-prob's gradient with respect to h."""
    monkeypatch.setattr(lm_head, "KEEP_LOG_PROBS_BYTES", 0)
    _, h, w, tokens, temps = _head_case(3)
    v = w.shape[0]

    def objective(h, w):
        logp, ent = lm_head.head_token_logprobs(_Head(w), h, tokens, temps, chunk_size=4)
        return jnp.sum(logp + (ent if entropy_grad else 0.0))

    jaxpr = jax.make_jaxpr(jax.grad(objective, wrt))(h, w).jaxpr
    dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    vocab = [e for e in dots if any(v in x.aval.shape for x in (*e.invars, *e.outvars))]
    assert len(vocab) == matmuls


# Packed scoring, with the dense segment mask, banded by blocks of 6 columns that attend the
# block before (the rows of 16 columns pad to 3 blocks; completions are at most T = 6 tokens
# long), or by blocks of 2 columns that attend the 3 blocks before.
PACKINGS = pytest.mark.parametrize(
    "packed", [False, True, (6, 1), (2, 3)], ids=["padded", "packed", "banded", "banded-back3"]
)


@pytest.fixture
def band(monkeypatch, packed):
    """Forces `packed`'s (width, back) band layout on the packed scoring, else the dense mask."""
    layout = packed if isinstance(packed, tuple) else (0, 0)
    monkeypatch.setattr(lp, "band_layout", lambda t, columns: layout)


def test_band_layout_rule():
    """Blocks of the power of two T2 >= T up to 128 columns, attending the block before; for
    longer completions blocks of max(T2 / 4, 128) attending the T2 / W blocks before; dense when
    the row is no wider than one window."""
    assert lp.band_layout(512, 4096) == (128, 4) and lp.band_layout(500, 4000) == (128, 4)
    assert lp.band_layout(256, 2048) == (128, 2) and lp.band_layout(1024, 8192) == (256, 4)
    assert lp.band_layout(6, 16) == (0, 0) and lp.band_layout(32, 64) == (0, 0)
    assert lp.band_layout(32, 128) == (32, 1) and lp.band_layout(512, 640) == (0, 0)


@PACKINGS
def test_shared_prefix_values_equal_plain_forward(packed, band):
    model = _model(lora=True)
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam, nnx.Param)
    batch = _batch()
    mask = batch[3].astype(bool)
    want_logp, want_ent = jax.jit(lambda *a: _reference(model, *a))(*batch)
    fn = lp.make_logprobs_fn(graphdef, group_size=G, chunk_size=4)
    logp, ent = fn(params, rest, *batch, _packing(batch) if packed else None)
    assert logp.shape == ent.shape == (B * G, T)
    np.testing.assert_allclose(np.where(mask, logp, 0), np.where(mask, want_logp, 0), atol=ATOL)
    np.testing.assert_allclose(np.where(mask, ent, 0), np.where(mask, want_ent, 0), atol=ATOL)


@PACKINGS
def test_shared_prefix_gradients_equal_unshared(packed, band):
    """Gradients through the shared prompt cache equal those of G separate full passes.

    Taken w.r.t. every weight (`nnx.Param` includes `LoRAParam`), so both the LoRA case and
    full fine-tuning are covered by one compiled pair.
    """
    model = _model(lora=True)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = _batch()
    mask = jnp.asarray(batch[3], jnp.float32)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B * G, T)), jnp.float32)

    def objective(params, scorer):
        logp, ent = scorer(nnx.merge(graphdef, params))
        return jnp.sum((weights * logp + 0.3 * ent) * mask)

    def shared(m):
        return _shared(m, *batch, packed=packed)

    def unshared(m):
        p_ids, p_mask = np.repeat(batch[0], G, 0), np.repeat(batch[1], G, 0)
        return lp.full_sequence_logprobs(m, p_ids, p_mask, *batch[2:], chunk_size=4)

    g_shared = jax.jit(jax.grad(lambda p: objective(p, shared)))(params)
    g_full = jax.jit(jax.grad(lambda p: objective(p, unshared)))(params)
    paths_s = jax.tree_util.tree_flatten_with_path(g_shared)[0]
    flat_f = jax.tree.leaves(g_full)
    assert len(paths_s) == len(flat_f) > 0
    assert any("lora" in jax.tree_util.keystr(p).lower() for p, _ in paths_s), "no LoRA grads"
    for (path, gs), gf in zip(paths_s, flat_f, strict=True):
        assert float(jnp.abs(gf).max()) > 1e-6, f"trivially zero gradient at {path}"
        np.testing.assert_allclose(gs, gf, atol=ATOL, rtol=1e-4, err_msg=str(path))


def _common_prefix_batch():
    """Prompts of 22 and 20 tokens whose first 19 agree (shared: 16, the multiple of 8 below),
    left-padded to 24, with the completions of `_batch`."""
    rng = np.random.default_rng(4)
    common = rng.integers(3, 300, 19)
    rows = [np.concatenate([common, rng.integers(3, 300, n)]) for n in (3, 1)]
    prompt_ids = np.zeros((B, 24), np.int32)
    prompt_mask = np.zeros((B, 24), np.int32)
    for i, row in enumerate(rows):
        prompt_ids[i, 24 - len(row) :], prompt_mask[i, 24 - len(row) :] = row, 1
    return (prompt_ids, prompt_mask, *_batch()[2:])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_common_prefix_scores_and_gradients_equal_unshared(packed):
    """Running the prompts' common prefix once for the batch (`shared_ids`) gives the log-probs
    and entropies of the plain forward over the whole prompts, and the gradients (w.r.t. every
    weight, LoRA included) of G separate full passes."""
    model = _model(lora=True)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = _common_prefix_batch()
    shared, ids, mask = split_common_prefix(batch[0], batch[1])
    assert shared.shape == (1, 16) and ids.shape == (B, 8)
    assert mask.sum(axis=1).tolist() == [22 - 16, 20 - 16]
    split_batch = (ids, mask, *batch[2:])
    packing = _packing(batch) if packed else None
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B * G, T)), jnp.float32)
    loss_mask = jnp.asarray(batch[3], jnp.float32)

    def shared_pass(m):
        return lp.shared_prefix_logprobs(
            m, *split_batch, group_size=G, chunk_size=4, packing=packing,
            shared_ids=jnp.asarray(shared),
        )  # fmt: skip

    def unshared(m):
        p_ids, p_mask = np.repeat(batch[0], G, 0), np.repeat(batch[1], G, 0)
        return lp.full_sequence_logprobs(m, p_ids, p_mask, *batch[2:], chunk_size=4)

    def objective(params, scorer):
        logp, ent = scorer(nnx.merge(graphdef, params))
        return jnp.sum((weights * logp + 0.3 * ent) * loss_mask), (logp, ent)

    grad = lambda scorer: jax.jit(jax.grad(lambda p: objective(p, scorer), has_aux=True))  # noqa: E731
    g_shared, (logp, ent) = grad(shared_pass)(params)
    g_full, (want_logp, want_ent) = grad(unshared)(params)
    on = batch[3].astype(bool)
    np.testing.assert_allclose(np.where(on, logp, 0), np.where(on, want_logp, 0), atol=ATOL)
    np.testing.assert_allclose(np.where(on, ent, 0), np.where(on, want_ent, 0), atol=ATOL)
    paths = jax.tree_util.tree_flatten_with_path(g_shared)[0]
    for (path, gs), gf in zip(paths, jax.tree.leaves(g_full), strict=True):
        assert float(jnp.abs(gf).max()) > 1e-6, f"trivially zero gradient at {path}"
        np.testing.assert_allclose(gs, gf, atol=ATOL, rtol=1e-4, err_msg=str(path))


def test_split_common_prefix_shares_only_what_every_prompt_begins_with():
    ids, mask = _common_prefix_batch()[:2]
    # Fewer than min_length common tokens, a single prompt, or prompts that differ at once.
    assert split_common_prefix(ids, mask, min_length=24)[0].shape == (1, 0)
    assert split_common_prefix(ids[:1], mask[:1])[0].shape == (1, 0)
    other = ids.copy()
    other[1, -20] += 1  # prompt 1's first token
    shared, same_ids, same_mask = split_common_prefix(other, mask)
    assert shared.shape == (1, 0) and same_ids is other and same_mask is mask
    # Rounded down to the multiple; each prompt keeps at least its own last token.
    shared, suffix, suffix_mask = split_common_prefix(ids, mask, min_length=4, multiple=4)
    assert shared.shape == (1, 16)
    twins = np.tile(ids[1:], (2, 1)), np.tile(mask[1:], (2, 1))  # two identical prompts
    shared, suffix, suffix_mask = split_common_prefix(*twins, min_length=4, multiple=1)
    assert shared.shape == (1, 19) and suffix_mask.sum(axis=1).tolist() == [1, 1]
    # The shared tokens followed by each suffix are the prompt again.
    shared, suffix, suffix_mask = split_common_prefix(ids, mask)
    for i in range(B):
        whole = np.concatenate([shared[0], suffix[i][suffix_mask[i] > 0]])
        assert whole.tolist() == ids[i][mask[i] > 0].tolist()


def test_pack_places_every_token_once():
    lengths = np.array([3, 1, 5, 2, 2, 2])
    packing = pack(lengths, 3, 8)
    assert packing.src_BL.shape == (2, 16)  # longest group 9 tokens -> bucket 16 (the least)
    tokens = np.arange(6 * 8).reshape(6, 8)
    packed = np.take_along_axis(tokens.reshape(2, 24), packing.src_BL, axis=1)
    valid = packing.seg_BL >= 0
    assert valid.sum(axis=1).tolist() == [9, 6]
    for n, length in enumerate(lengths):
        cols = packing.unpack_NT[n, :length]
        assert (packed[n // 3, cols] == tokens[n, :length]).all()
        assert (packing.pos_BL[n // 3, cols] == np.arange(length)).all()
        assert (packing.seg_BL[n // 3, cols] == n % 3).all()
        assert (packing.unpack_NT[n, length:] == 16).all()
    assert pack(np.full(6, 8), 3, 8).src_BL.shape == (2, 24)  # 32, capped at G * T
    # Half-octave buckets above the least: a longest group of 88 tokens -> 96, not 128 ...
    assert pack(np.full(8, 11), 8, 32).src_BL.shape == (1, 96)
    # ... or a multiple of 128 columns where that is narrower: 2,784 tokens -> 2,816, not 3,072.
    assert pack(np.full(8, 2780 // 8 + 1), 8, 512).src_BL.shape == (1, 2816)
    assert pack(np.full(8, 2048 // 8), 8, 512).src_BL.shape == (1, 2048)


def _eqns(jaxpr):
    """Every equation of a jaxpr, recursing into scan/remat/pjit/custom-VJP bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _shapes(jaxpr):
    """Every intermediate shape of a jaxpr, recursing into scan/remat/pjit bodies."""
    for eqn in _eqns(jaxpr):
        for var in eqn.outvars:
            yield getattr(var.aval, "shape", ())


@pytest.mark.parametrize(
    "rows, t, asked, expected",
    [(1, 3072, 64, 256), (4, 3072, 64, 64), (2, 3072, 64, 128), (1, 100, 64, 100), (64, 40, 8, 8)],
)
def test_head_blocks_have_enough_rows_for_the_matmul_on_cpu(rows, t, asked, expected):
    """On CPU a logits block has at least the layout's 256 rows x positions (never fewer
    positions than asked, never more than the sequence), so a micro-batch of one packed row
    does not run the head's matmul 64 rows at a time; other platforms keep the asked size."""
    cpu = Layout.for_platform("cpu").head_chunk_rows
    tpu = Layout.for_platform("tpu").head_chunk_rows
    assert (cpu, tpu) == (256, 0)
    assert lm_head.head_chunk(rows, t, asked, cpu) == expected
    assert lm_head.head_chunk(rows, t, asked, tpu) == min(asked, t)


def test_no_full_vocabulary_logits_for_the_whole_sequence(monkeypatch):
    """Past the keep budget, forward and backward never hold logits for more than one chunk
    of positions."""
    monkeypatch.setattr(lm_head, "KEEP_LOG_PROBS_BYTES", 0)
    model = _model(lora=True)
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
    batch = _batch()
    v = model.cfg.vocab_size
    chunk = 2

    def loss(params):
        logp, ent = _shared(nnx.merge(graphdef, params, rest), *batch, chunk_size=chunk)
        return jnp.sum(logp) + jnp.sum(ent)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
    vocab_shapes = [s for s in _shapes(jaxpr.jaxpr) if len(s) >= 2 and s[-1] == v]
    assert vocab_shapes, "expected some [..., V] logits"
    biggest = max(int(np.prod(s[:-1])) for s in vocab_shapes)
    assert biggest <= B * G * chunk, f"logits for {biggest} positions at once: {vocab_shapes}"
