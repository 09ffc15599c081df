"""Episodes of several turns with a scripted policy (a stand-in for the model that writes a
fixed calculator call, then an answer): the episode's ids are the drawn ids cut after the call,
then the result's ids, then the next turn's; results carry model mask 0, no log-prob and no
temperature; the continuation is sampled from prompt + episode so far within the budget."""

import types

import numpy as np
import pytest

from jaxgrpo.agents import Toolbox, calc, get_format
from jaxgrpo.agents.rollout import AgentLimits, run_episodes
from jaxgrpo.agents.seam import turn_end
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import bucket_length

T = 64
LOGP = -0.5


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _encode(tok, text):
    return tok.hf.encode(text, add_special_tokens=False)


class Scripted:
    """Turn 0 of row 0 calls the calculator and runs on past the call (ids the rollout must
    drop); every later turn, and row 1's first, answers and stops. Records each call."""

    def __init__(self, tok):
        self.tok, self.calls, self.resumes = tok, [], []
        eos = tok.eos_ids[0]
        self.call_turn = _encode(tok, "Let me compute <calc>3*4+5</calc> then I go on rambling")
        self.answer = [*_encode(tok, "<answer>17</answer>"), eos]

    def __call__(self, ids, mask, num_samples, max_lengths, turn, resume=None):
        self.calls.append((np.asarray(ids), np.asarray(mask), num_samples, max_lengths, turn))
        self.resumes.append(resume)
        n = ids.shape[0] * num_samples
        turns = [self.call_turn if (turn == 0 and r == 0) else self.answer for r in range(n)]
        tokens = np.zeros((n, T), np.int32)
        for r, t in enumerate(turns):
            tokens[r, : len(t)] = t
        return types.SimpleNamespace(
            tokens=tokens,
            lengths=np.asarray([len(t) for t in turns]),
            logprobs=np.full((n, T), LOGP, np.float32),
            temperatures=np.full((n, T), 0.7, np.float32),
        )


def _run(tok, policy, limits=AgentLimits()):
    fmt = get_format("tag", [Toolbox([calc]).schemas[0]])
    ids, mask = tok.encode(["What is 3*4+5?"])
    boxes = [Toolbox([calc]) for _ in range(2)]
    batch = run_episodes(
        policy, tok, fmt, boxes, ids, mask, group=2, max_new_tokens=T, limits=limits
    )
    return batch, ids, mask


def test_a_scripted_episode_end_to_end(tok):
    policy = Scripted(tok)
    batch, ids, mask = _run(tok, policy)
    keep = turn_end(tok, policy.call_turn, ("</calc>",))
    assert tok.hf.decode(policy.call_turn[:keep]).endswith("</calc>")
    result = _encode(tok, "<result>17</result>")
    want = policy.call_turn[:keep] + result + policy.answer
    n = len(want)
    assert batch.lengths.tolist() == [n, len(policy.answer)]
    np.testing.assert_array_equal(batch.tokens[0, :n], want)
    assert (batch.tokens[0, n:] == tok.pad_id).all() and batch.mask[0].sum() == n
    model = [1] * keep + [0] * len(result) + [1] * len(policy.answer)
    np.testing.assert_array_equal(batch.model_mask[0, :n], model)
    tool = (batch.mask[0] == 1) & (batch.model_mask[0] == 0)
    assert tok.hf.decode(batch.tokens[0][tool].tolist()) == "<result>17</result>"
    np.testing.assert_array_equal(batch.logprobs[0], np.where(batch.model_mask[0], LOGP, 0.0))
    np.testing.assert_array_equal(
        batch.temperatures[0], np.where(batch.model_mask[0], np.float32(0.7), np.float32(1.0))
    )
    first, second = batch.episodes
    assert (first.num_turns, first.tool_calls, dict(first.failures)) == (2, 1, {})
    assert first.turns[0].calls[0].arguments == {"expression": "3*4+5"}
    assert first.turns[0].results[0].text == "17"
    assert first.turns[1].text == "<answer>17</answer>"
    assert (second.num_turns, second.tool_calls) == (1, 0)


def test_the_continuation_is_sampled_from_prompt_and_episode_within_the_budget(tok):
    policy = Scripted(tok)
    batch, ids, mask = _run(tok, policy)
    assert [c[4] for c in policy.calls] == [0, 1], "one continuation, for the row that called"
    ctx, ctx_mask, samples, budget, _ = policy.calls[1]
    # The batch's two rows, the one that did not call padded with a budget of 1.
    assert samples == 1 and ctx.shape[0] == 2
    prompt = ids[0][mask[0] != 0].tolist()
    so_far = batch.tokens[0, : batch.lengths[0] - len(policy.answer)].tolist()
    assert ctx[0][ctx_mask[0] != 0].tolist() == prompt + so_far
    assert (ctx_mask[0][: -len(prompt + so_far)] == 0).all(), "left-padded"
    assert budget.tolist() == [T - len(so_far), 1]
    # From the cache: row 0 of turn 0 goes on; its turn's ids before the last kept one are
    # in the cache (slots 0 .. keep - 2), and the chunk re-feeds that id, then the result.
    keep = turn_end(tok, policy.call_turn, ("</calc>",))
    resume = policy.resumes[1]
    assert policy.resumes[0] is None and resume.rows.tolist() == [0, 0]
    assert resume.valid_until.tolist() == [keep - 1] * 2 and resume.width == bucket_length(T - 1)
    assert resume.positions.tolist() == [len(prompt) + keep - 1] * 2
    chunk = [policy.call_turn[keep - 1], *_encode(tok, "<result>17</result>")]
    assert resume.ids[0][resume.mask[0] != 0].tolist() == chunk


def test_max_turns_ends_the_episode_at_the_call(tok):
    """With one turn allowed, the call is recorded but not run, and nothing follows it."""
    policy = Scripted(tok)
    batch, _, _ = _run(tok, policy, AgentLimits(max_turns=1))
    keep = turn_end(tok, policy.call_turn, ("</calc>",))
    assert batch.lengths[0] == keep and batch.model_mask[0].sum() == keep
    assert batch.episodes[0].tool_calls == 0 and len(policy.calls) == 1


def test_a_long_result_is_cut_and_counted(tok):
    def shout(text: str) -> str:
        """Repeats the text.

        Args:
            text: what to repeat.
        """
        return text * 40

    fmt = get_format("tag", [Toolbox([shout]).schemas[0]])
    call = _encode(tok, "<shout>ab</shout>")
    answer = [*_encode(tok, "ok"), tok.eos_ids[0]]

    def policy(ids, mask, num_samples, max_lengths, turn, resume=None):
        turn_ids = call if turn == 0 else answer
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(turn_ids)] = turn_ids
        return types.SimpleNamespace(
            tokens=tokens,
            lengths=np.asarray([len(turn_ids)]),
            logprobs=np.zeros((1, T), np.float32),
            temperatures=np.ones((1, T), np.float32),
        )

    ids, mask = tok.encode(["x"])
    limits = AgentLimits(max_tool_tokens=5)
    batch = run_episodes(
        policy, tok, fmt, [Toolbox([shout])], ids, mask, group=1, max_new_tokens=T, limits=limits
    )
    assert batch.episodes[0].truncated_results == 1
    tool = (batch.mask[0] == 1) & (batch.model_mask[0] == 0)
    shown = tok.hf.decode(batch.tokens[0][tool].tolist())
    inner = shown.removeprefix("<result>").removesuffix("</result>")
    assert len(_encode(tok, inner)) <= 5 and "ab" in inner


def test_greedy_continuation_equals_greedy_decoding_of_the_whole_context(tok):
    """The tiny model continues after a scripted call: its turn is what greedy decoding of
    prompt + call + result gives on its own, within the episode's remaining budget (the
    continuation runs through `model_sampler` and `jaxgrpo.sampling.generate`)."""
    import functools

    import jax

    from jaxgrpo.agents.rollout import model_sampler
    from jaxgrpo.models.tiny import tiny_model
    from jaxgrpo.sampling import SamplerSettings, generate

    model, _ = tiny_model(seed=0)
    settings = SamplerSettings.for_tokenizer(tok, max_new_tokens=96, temperature=0.0)
    greedy = model_sampler(functools.partial(generate, model), settings, jax.random.key(0))
    script = Scripted(tok)

    def policy(ids, mask, num_samples, max_lengths, turn, resume=None):
        if turn == 0:
            out = script(ids, mask, num_samples, max_lengths, turn)
            out.tokens, out.lengths = out.tokens[:1], out.lengths[:1]
            return out
        return greedy(ids, mask, num_samples, max_lengths, turn)

    fmt = get_format("tag", [Toolbox([calc]).schemas[0]])
    ids, mask = tok.encode(["What is 3*4+5?"])
    batch = run_episodes(policy, tok, fmt, [Toolbox([calc])], ids, mask, group=1, max_new_tokens=96)
    keep = turn_end(tok, script.call_turn, ("</calc>",))
    so_far = script.call_turn[:keep] + _encode(tok, "<result>17</result>")
    context = ids[0][mask[0] != 0].tolist() + so_far
    alone = generate(
        model,
        np.asarray([context], np.int32),
        np.ones((1, len(context)), np.int32),
        settings,
        rng=jax.random.key(1),
        max_lengths=96 - len(so_far),
    )
    n = int(alone.lengths[0])
    assert n > 1 and batch.lengths[0] == len(so_far) + n, (n, batch.lengths[0], len(so_far))
    np.testing.assert_array_equal(
        batch.tokens[0, len(so_far) : len(so_far) + n], alone.tokens[0, :n]
    )
    np.testing.assert_allclose(
        batch.logprobs[0, len(so_far) : len(so_far) + n], alone.logprobs[0, :n], atol=1e-5
    )


class EveryTurnCalls:
    """A format whose every turn calls ``echo`` (the tiny random model writes no real calls):
    each turn is kept whole and answered by ``<r>ok</r>`` in the same turn."""

    same_turn = True

    def stop_strings(self):
        return ()

    def parse(self, text):
        from jaxgrpo.agents.formats import ToolCall

        return [ToolCall(name="echo", arguments={}, raw=text)]

    def render_results(self, texts):
        return "".join(f"<r>{text}</r>" for _, text in texts)


@pytest.mark.parametrize("shape", [{"data": 1}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_episodes_from_the_kept_cache_score_as_one_pass(tok, shape):
    """Episodes of three turns of the tiny model's own samples (temperature 1) through
    `mesh_sampler`, each later turn continued from the cache of the turn before (rows of
    different lengths, compacted and padded; on one device and sharded over 8) after a
    result: the log-prob the sampler gave each drawn id equals one forward pass over prompt
    and whole episode (1e-5, float32)."""
    import jax
    from flax import nnx

    from jaxgrpo.core.sharding import make_mesh
    from jaxgrpo.eval.completions import mesh_sampler
    from jaxgrpo.models.tiny import tiny_model
    from jaxgrpo.sampling import SamplerSettings

    def echo() -> str:
        """Says ok."""
        return "ok"

    devices = jax.devices()[: int(np.prod(list(shape.values())))]
    mesh = make_mesh(shape, devices)
    model, _ = tiny_model(seed=0, mesh=mesh if len(devices) > 1 else None)
    graphdef, state = nnx.split(model)
    settings = SamplerSettings.for_tokenizer(tok, max_new_tokens=T, temperature=1.0)
    sample = mesh_sampler(
        graphdef, (state,), model.cfg, mesh, settings, jax.random.key(0), keep_cache=True
    )
    turn_lengths = np.asarray([3, 7, 5, 9])  # each row's turns stop after this many ids

    def short_turns(ids, mask, num_samples, max_lengths, turn, resume=None):
        rows = ids.shape[0] * num_samples if resume is None else resume.ids.shape[0]
        cap = np.resize(turn_lengths + turn, rows).astype(np.int32)
        budget = cap if max_lengths is None else np.minimum(max_lengths, cap)
        return sample(ids, mask, num_samples, budget, turn, resume)

    ids, mask = tok.encode(["What is 3*4+5?", "Hi"])
    boxes = [Toolbox([echo]) for _ in range(4)]
    batch = run_episodes(
        lambda *a: types.SimpleNamespace(**short_turns(*a)),
        tok,
        EveryTurnCalls(),
        boxes,
        ids,
        mask,
        group=2,
        max_new_tokens=T,
        limits=AgentLimits(max_turns=3),
    )
    assert [e.num_turns for e in batch.episodes] == [3] * 4
    for r in range(4):
        prompt = ids[r // 2][mask[r // 2] != 0].tolist()
        n = int(batch.lengths[r])
        seq = np.asarray([prompt + batch.tokens[r, :n].tolist()], np.int32)
        logits = model.logits(model.forward(seq))[0, len(prompt) - 1 : -1]
        logp = jax.nn.log_softmax(logits.astype(np.float32), axis=-1)
        want = np.take_along_axis(np.asarray(logp), batch.tokens[r, :n, None], axis=1)[:, 0]
        drawn = batch.model_mask[r, :n] == 1
        assert drawn.sum() == 3 * (turn_lengths[r] + 1) and (~drawn).sum() > 0
        np.testing.assert_allclose(batch.logprobs[r, :n][drawn], want[drawn], atol=1e-5)


def test_later_turns_compile_nothing_after_the_warm_up(tok):
    """`warm_later_turns` compiles every later-turn program of a prompt shape up front: then
    episodes whose turns resume from a first turn's cache and from a later turn's, with short
    results (one resume pass) and long ones (several), compile nothing."""
    import jax
    from flax import nnx

    from jaxgrpo.agents.rollout import warm_later_turns
    from jaxgrpo.core.sharding import make_mesh
    from jaxgrpo.eval.completions import mesh_sampler
    from jaxgrpo.models.tiny import tiny_model
    from jaxgrpo.sampling import SamplerSettings
    from jaxgrpo.sampling.resume import APPEND
    from tests.learner_helpers import count_compiles

    said = []

    def echo() -> str:
        """Says ok, then a long text."""
        said.append(1)
        return "ok" if len(said) % 2 else " ".join(["word"] * (2 * APPEND + 4))

    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    model, _ = tiny_model(seed=0)
    graphdef, state = nnx.split(model)
    t = 160
    settings = SamplerSettings.for_tokenizer(tok, max_new_tokens=t, temperature=1.0)
    sample = mesh_sampler(
        graphdef, (state,), model.cfg, mesh, settings, jax.random.key(0), keep_cache=True
    )

    def short_turns(ids, mask, num_samples, max_lengths, turn, resume=None):
        rows = ids.shape[0] * num_samples if resume is None else resume.ids.shape[0]
        cap = np.full(rows, 2, np.int32)
        budget = cap if max_lengths is None else np.minimum(max_lengths, cap)
        return sample(ids, mask, num_samples, budget, turn, resume)

    ids, mask = tok.encode(["What is 3*4+5?", "Hi"])
    warm_later_turns(short_turns, ids, mask, group=2, max_new_tokens=t, pad_id=tok.pad_id)
    with count_compiles() as compiled:
        batch = run_episodes(
            lambda *a: types.SimpleNamespace(**short_turns(*a)),
            tok,
            EveryTurnCalls(),
            [Toolbox([echo]) for _ in range(4)],
            ids,
            mask,
            group=2,
            max_new_tokens=t,
            limits=AgentLimits(max_turns=4, max_tool_tokens=4 * APPEND),
        )
    assert max(e.num_turns for e in batch.episodes) == 4
    wide = [len(t.results[0].text.split()) > APPEND for e in batch.episodes for t in e.turns[:-1]]
    assert any(wide) and not all(wide), "results of one pass and of several must occur"
    assert not compiled, f"{len(compiled)} programs compiled after the warm-up"


def test_held_out_episodes_run_the_training_later_turn_programs(tok):
    """The held-out evaluation's sampler (greedy, one episode per prompt, a typed key of this
    process) and the training's (sampling, G episodes per prompt, a raw key on the mesh) run
    the same later-turn programs: one ``resume`` and one ``decode``, which the held-out first
    turn runs too."""
    import jax
    from flax import nnx

    from jaxgrpo.agents.rollout import warm_later_turns
    from jaxgrpo.core import sharding
    from jaxgrpo.core.sharding import make_mesh
    from jaxgrpo.eval.completions import mesh_sampler
    from jaxgrpo.models.tiny import tiny_model
    from jaxgrpo.sampling import SamplerSettings
    from jaxgrpo.sampling.resume import APPEND, resume_programs

    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    model, _ = tiny_model(seed=0)
    graphdef, state = nnx.split(model)
    t = 48
    ids, mask = tok.encode(["What is 3*4+5?", "Hi"])

    def sampler(temperature, key):
        settings = SamplerSettings.for_tokenizer(tok, max_new_tokens=t, temperature=temperature)
        return settings, mesh_sampler(
            graphdef, (state,), model.cfg, mesh, settings, key, keep_cache=True
        )

    def sizes(settings):  # the programs a later turn of 4 rows looks up, and their shapes
        resume, decode, _ = resume_programs(
            graphdef, model.cfg, np.zeros((4, APPEND), np.int32), settings
        )
        return resume._cache_size(), decode._cache_size()

    warm = dict(max_new_tokens=t, pad_id=tok.pad_id)
    held_out, sample = sampler(0.0, jax.random.key(7))
    warm_later_turns(sample, np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), group=1, **warm)
    before = sizes(held_out)
    raw = sharding.put_whole(np.asarray(jax.random.key_data(jax.random.key(0))), mesh)
    training, sample = sampler(1.0, raw)
    warm_later_turns(sample, ids, mask, group=2, **warm)
    # The held-out first turn (one episode per prompt) is laid out as a later turn: one decode
    # program for both, and one resume program.
    assert before == (1, 1) and sizes(training) == before
