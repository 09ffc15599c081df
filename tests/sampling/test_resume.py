"""A later turn from the kept KV cache (``resume_from_state``) against sampling the whole
context afresh: each row's turn is cut, ids are appended, and greedy decoding goes on from the
cache; its tokens and log-probs must equal ``generate`` over prompt + kept ids + appended ids
(1e-5, float32), with compacted rows written back, through both decode loops, and with results
longer than one resume pass (``APPEND`` ids)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models.layout import Layout
from jaxgrpo.models.tiny import tiny_model
from jaxgrpo.sampling import SamplerSettings, generate, generate_from_state
from jaxgrpo.sampling.resume import APPEND, resume_from_state

T = 20


def _alone(model, context, budget):
    """Greedy decoding of ``context`` on its own, ``budget`` tokens at most."""
    settings = SamplerSettings(max_new_tokens=T, temperature=0.0, max_lengths=budget)
    out = generate(
        model,
        np.asarray([context], np.int32),
        np.ones((1, len(context)), np.int32),
        settings,
        rng=jax.random.key(3),
    )
    n = int(out.lengths[0])
    return np.asarray(out.tokens[0, :n]), np.asarray(out.logprobs[0, :n])


@pytest.mark.parametrize(
    "loop,long,group",
    [("scan", False, 2), ("unroll", False, 2), ("unroll", True, 2), ("unroll", True, 1)],
)
def test_a_later_turn_from_the_cache_equals_decoding_the_whole_context(loop, long, group):
    model, _ = tiny_model(seed=0)
    model.cfg = model.cfg.replace(layout=Layout(decode_loop=loop))
    graphdef, state = nnx.split(model)
    prompts = np.asarray([[0, 0, 5, 9, 17, 4], [0, 7, 3, 3, 8, 2]], np.int32)
    prompt_mask = (np.arange(6)[None, :] >= np.asarray([[2], [1]])).astype(np.int32)
    # Two samples per prompt with different lengths: rows stop at 6, 20, 9 and 14 tokens, and
    # the loop compacts to 2 rows, then 1, so kept rows come back from the compacted caches.
    # Group 1: each prompt twice, one sample each, the first turn laid out as a later one.
    first = SamplerSettings(
        max_new_tokens=T,
        temperature=1.0,
        num_samples=group,
        max_lengths=np.asarray([6, 20, 9, 14], np.int32),
        compact_rows=(2, 1),
        keep_cache=True,
    )
    ids, ids_mask = (
        (prompts, prompt_mask)
        if group == 2
        else (np.repeat(prompts, 2, 0), np.repeat(prompt_mask, 2, 0))
    )
    out = generate_from_state(
        graphdef, (state,), model.cfg, ids, ids_mask, first, rng=jax.random.key(0)
    )
    tokens = np.asarray(out.tokens)
    # Rows 3 and 1 go on (in that order) after keeping 4 and 11 of their ids (what follows
    # the cut was sampled past it); each appends a "result" of its own length.
    rows, kept = np.asarray([3, 1]), np.asarray([4, 11])
    # Long: row 1's chunk (21 ids) takes two passes, the first holding 5 of its ids.
    results = [[11, 12, 13], list(range(20, 40)) if long else [20, 21, 22, 23, 24]]
    chunks = [[int(tokens[r, k - 1]), *res] for r, k, res in zip(rows, kept, results, strict=True)]
    width = -(-max(map(len, chunks)) // APPEND) * APPEND
    assert width == (2 if long else 1) * APPEND
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for i, c in enumerate(chunks):
        ids[i, width - len(c) :], mask[i, width - len(c) :] = c, 1
    prompt_len = prompt_mask.sum(1)[rows // 2]
    budgets = np.asarray([T - 2, 7], np.int32)
    later = SamplerSettings(max_new_tokens=T, temperature=0.0, max_lengths=budgets)
    resumed = resume_from_state(
        graphdef,
        (state,),
        model.cfg,
        out.cache,
        rows,
        kept - 1,  # a first call's token j sits at completion slot j
        prompt_len + kept - 1,
        ids,
        mask,
        32,  # slots for each row's kept ids and those of its earlier passes
        later,
        rng=jax.random.key(1),
    )
    for i, (r, k, res) in enumerate(zip(rows, kept, results, strict=True)):
        prompt = prompts[r // 2][prompt_mask[r // 2] != 0].tolist()
        context = prompt + tokens[r, :k].tolist() + res
        want_tokens, want_logp = _alone(model, context, int(budgets[i]))
        n = int(resumed.lengths[i])
        assert n == len(want_tokens) > 1
        np.testing.assert_array_equal(np.asarray(resumed.tokens[i, :n]), want_tokens)
        np.testing.assert_allclose(np.asarray(resumed.logprobs[i, :n]), want_logp, atol=1e-5)
