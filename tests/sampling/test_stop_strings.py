"""Stop strings inside the compiled decode loop: the per-token tables against a brute-force
search of the decoded text, the loop over a fake model (a row stops at its string, the others
go on, the tokens equal an unstopped run's up to the stop, compaction drops stopped rows), and
real tokenizers' merges (SmolLM2 writes ``</calc><result>`` as ``</`` ``calc`` ``><`` ...)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo import sampling
from jaxgrpo.sampling import LoopConfig, StopReason
from jaxgrpo.sampling.stop_strings import StopTables, check_stop_strings, token_bytes
from tests.sampling.test_sampling import (
    bigram_step,
    fake_cache,
    successor_table,
    tiny,  # noqa: F401  (the tiny model fixture)
)

# A vocabulary of 16 ids whose bytes split and merge "</c>" and "ab" in several ways.
VOCAB = [
    b"</", b"c", b">", b"><", b"</c>", b"x", b"", b"a", b"b", b"ab", b"c>.", b"<", b"/",
    b"c></", b"<|end|>", b"z",
]  # fmt: skip


def first_stop(tokens, strings, vocab=VOCAB):
    """Brute force: the index of the first token after which the text contains a string."""
    text = b""
    for i, t in enumerate(tokens):
        text += vocab[t]
        if any(s.encode() in text for s in strings):
            return i
    return None


def run_tables(tables, tokens):
    step = jax.jit(tables.advance)
    state = tables.start(1)
    for i, t in enumerate(tokens):
        state, hit = step(state, jnp.asarray([t], jnp.int32))
        if bool(hit[0]):
            return i
    return None


@pytest.mark.parametrize("strings", [("</c>",), ("</c>", "ab"), ("c>", "</c></"), ("<|end|>",)])
def test_tables_match_the_decoded_text(strings):
    """Random token streams: the tables stop at the first token whose text completes a string,
    exactly where a search of the decoded bytes does (splits, merges, empty tokens, overhang)."""
    tables = StopTables.build(strings, VOCAB)
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(150):
        tokens = rng.integers(0, len(VOCAB), size=int(rng.integers(1, 12))).tolist()
        want = first_stop(tokens, strings)
        assert run_tables(tables, tokens) == want, (tokens, strings)
        hits += want is not None
    assert hits > 20, "the random streams must complete the strings often enough to test"


def test_split_and_overhang():
    """`</` `c` `><`: the string ends inside the last id, whose overhang `<` does not matter."""
    tables = StopTables.build(("</c>",), VOCAB)
    assert run_tables(tables, [0, 1, 3]) == 2
    assert run_tables(tables, [12, 1, 2]) is None  # "/c>": no "<" before it
    assert run_tables(tables, [11, 6, 12, 6, 10]) == 4  # "<", "", "/", "", "c>."
    assert run_tables(tables, [13, 1, 2]) == 2  # "c></" then "c" then ">"


def test_bad_stop_strings_name_the_key():
    with pytest.raises(ValueError, match="agent.stop: stop strings must be non-empty"):
        check_stop_strings(["</c>", ""], "agent.stop")
    with pytest.raises(ValueError, match="'</c>' is given twice"):
        check_stop_strings(["</c>", "</c>"])


def bytes_vocab(v):
    """A vocabulary of v ids for the successor model: id i is the letter chr(97 + i)."""
    return [bytes([97 + i]) for i in range(v)]


def loop(prompts, *, t, strings=(), compact_rows=()):
    """The successor model's loop (prompt ending in s emits s+1, s+2, ...) with stop strings
    over the letters a.. (id i = chr(97 + i))."""
    table = successor_table()
    b, p = prompts.shape
    stop = StopTables.build(strings, bytes_vocab(table.shape[0])) if strings else None
    cfg = LoopConfig(max_new_tokens=t, compact_rows=compact_rows)
    knobs = sampling.make_knobs(b, t, temperature=0.0, stop=stop)

    @jax.jit
    def go(ids, knobs):
        state = sampling.prefill(
            bigram_step, table, ids, jnp.ones_like(ids), fake_cache(b, p + t), knobs,
            jax.random.key(0), cfg,
        )  # fmt: skip
        return sampling.decode(bigram_step, table, state, knobs, cfg)

    return go(jnp.asarray(prompts, jnp.int32), knobs)


def test_loop_stops_a_row_at_its_string_and_the_others_go_on():
    """Rows emit "bcdefgh...", "fghijk...", "klmnop...": "bcd" stops row 0 after 3 tokens,
    "jk" row 1 after 6 (f g h i j k), row 2 meets neither and runs to T; the tokens before
    each stop equal the unstopped run's."""
    prompts = np.array([[0], [4], [9]])
    free = loop(prompts, t=8)
    stopped = loop(prompts, t=8, strings=("bcd", "jk"))
    np.testing.assert_array_equal(stopped.lengths_R, [3, 6, 8])
    assert list(stopped.stop_reason_R) == [StopReason.STOP_STRING] * 2 + [StopReason.LENGTH]
    for r, n in enumerate([3, 6, 8]):
        np.testing.assert_array_equal(stopped.tokens_RT[r, :n], free.tokens_RT[r, :n])
        assert np.all(np.asarray(stopped.tokens_RT[r, n:]) == 0), "pad after the stop"
        np.testing.assert_array_equal(stopped.mask_RT[r], np.arange(8) < n)


@pytest.mark.parametrize("compact_rows", [4, (8, 2)])
def test_stopped_rows_drop_out_of_compaction(tiny, compact_rows):  # noqa: F811
    """The tiny model sampled at temperature 1 with stop strings over a letter vocabulary:
    rows stop at their strings, and decoding only the running rows once few are left gives
    the same tokens, masks and stop reasons as decoding every row to the end."""
    model, ids, mask = tiny
    vocab = [bytes([97 + i % 26]) for i in range(model.cfg.vocab_size)]
    stop = StopTables.build(("ab", "q", "zz"), vocab)
    kw = dict(
        rng=jax.random.key(3), max_new_tokens=24, temperature=1.0, num_samples=4, eos_ids=(),
        stop=stop, stop_strings=("ab", "q", "zz"),
    )  # fmt: skip
    full = sampling.generate(model, ids, mask, compact_rows=0, **kw)
    compact = sampling.generate(model, ids, mask, compact_rows=compact_rows, **kw)
    reasons = np.asarray(full.stop_reason)
    assert (reasons == StopReason.STOP_STRING).sum() >= 4, "too few rows met a stop string"
    assert (reasons == StopReason.LENGTH).any(), "no row ran to the end"
    for name in ("tokens", "mask", "lengths", "stop_reason", "steps"):
        np.testing.assert_array_equal(getattr(compact, name), getattr(full, name), err_msg=name)
    for r in np.flatnonzero(reasons == StopReason.STOP_STRING):
        text = b"".join(vocab[t] for t in np.asarray(full.tokens)[r, : int(full.lengths[r])])
        assert any(s in text for s in (b"ab", b"q", b"zz")), text
        assert not any(s in text[:-1] for s in (b"ab", b"q", b"zz")), "stopped late"


def test_real_tokenizer_merges(smollm2_gguf):
    """SmolLM2's byte-level vocabulary: `</calc><result>` is `</` `calc` `><` `result` `>` and
    `</calc>.` ends in `>.`; the tables stop at the id that completes `</calc>` in each, and at
    the `><` of a text that closes another tag first."""
    from jaxgrpo.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    vocab = token_bytes(tok.hf)
    assert len(vocab) == len(tok.hf)
    tables = StopTables.build(("</calc>",), vocab)
    for text in ["<calc>3*4</calc><result>", "<calc>2+2</calc>. So", "x</answer></calc><"]:
        ids = tok.hf.encode(text, add_special_tokens=False)
        want = first_stop(ids, ("</calc>",), vocab)
        assert want is not None and run_tables(tables, ids) == want, text
        assert "</calc>" in tok.hf.decode(ids[: want + 1])
        assert "</calc>" not in tok.hf.decode(ids[:want])
