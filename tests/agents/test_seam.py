"""The seam between a calling turn and what follows it, with real tokenizers: whatever the
tokenizer merged into the call's last id, the episode's text is the model's call followed by
exactly the format's text (``rollout.Seam``), model ids are never tokenized again, results
that overflow the budget are left out whole and calls that cannot run are counted.

SmolLM2's byte-level BPE writes ``</calc><result>`` as ``</`` ``calc`` ``><`` ``result``
``>`` and ``</calc>.`` as ``</`` ``calc`` ``>.``: the id that completes the stop string
carries text past it.
"""

import types

import numpy as np
import pytest

from jaxgrpo.agents import Toolbox, calc, get_format
from jaxgrpo.agents.rollout import AgentLimits, run_episodes
from jaxgrpo.agents.seam import cut_turn
from jaxgrpo.models.tokenizer import Tokenizer

T = 96
LLAMA_SPECIALS = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
      a: the first.
      b: the second.
    """
    return a + b


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def llama_like(smollm2_gguf):
    """SmolLM2's vocabulary and merges with Llama 3.1's control tokens added, `<|eot_id|>` a
    stop id: the llama3 format's turns end at it as they do with Llama's own tokenizer."""
    tok = Tokenizer.from_gguf(smollm2_gguf)
    tok.hf.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
    eot = tok.hf.convert_tokens_to_ids("<|eot_id|>")
    return Tokenizer(tok.hf, extra_eos_ids=[eot])


class Script:
    """Row r writes ``turns[r][k]`` at its turn k (ids as given: a text, or ids), ending each
    text turn with the tokenizer's first stop id when ``end`` is set."""

    def __init__(self, tok, turns, end=False):
        self.tok, self.turns, self.end, self.count = tok, turns, end, {}

    def ids(self, r):
        k = self.count.get(r, 0)
        self.count[r] = k + 1
        turn = self.turns[r][min(k, len(self.turns[r]) - 1)]
        ids = self.tok.hf.encode(turn, add_special_tokens=False) if isinstance(turn, str) else turn
        return [*ids, self.tok.eos_ids[0]] if self.end and isinstance(turn, str) else list(ids)

    def __call__(self, ids, mask, num_samples, max_lengths, turn, resume=None):
        live = range(ids.shape[0] * num_samples) if turn == 0 else self._live
        rows = [self.ids(r) for r in live]
        self._live = [r for r in live]  # a later turn samples the calling rows in order
        tokens = np.zeros((len(rows), T), np.int32)
        for i, t in enumerate(rows):
            tokens[i, : len(t)] = t
        return types.SimpleNamespace(
            tokens=tokens,
            lengths=np.asarray([len(t) for t in rows]),
            logprobs=np.full((len(rows), T), -0.5, np.float32),
            temperatures=np.ones((len(rows), T), np.float32),
        )


def episode(tok, fmt, script, tools, *, t=T, limits=AgentLimits(max_turns=3)):
    ids, mask = tok.encode(["Q?"])
    boxes = [Toolbox(tools) for _ in range(len(script.turns))]
    batch = run_episodes(
        script, tok, fmt, boxes, ids, mask, group=len(script.turns), max_new_tokens=t,
        limits=limits,
    )  # fmt: skip
    return batch


def text_of(tok, batch, r, model=None):
    keep = batch.mask[r] == 1
    if model is not None:
        keep &= batch.model_mask[r] == model
    return tok.hf.decode(batch.tokens[r][keep].tolist(), skip_special_tokens=False)


def tag_format():
    return get_format("tag", [Toolbox([calc]).schemas[0]])


def test_the_merged_id_overhangs_into_the_result(smollm2):
    """`><` completes `</calc>` and carries `<`: the id is kept, and the appended ids write
    the rest of `<result>12</result>`."""
    turn = "<calc>3*4</calc><result>99</result> lies"
    ids = smollm2.hf.encode(turn, add_special_tokens=False)
    seam = cut_turn(smollm2, ids, ("</calc>",))
    assert seam.text.endswith("</calc>") and seam.overhang == "<"
    batch = episode(smollm2, tag_format(), Script(smollm2, [[turn, "<answer>12</answer>"]]), [calc])
    text = text_of(smollm2, batch, 0)
    assert "<calc>3*4</calc><result>12</result><answer>12</answer>" in text, text
    assert "<<result>" not in text
    model_ids = batch.tokens[0][batch.model_mask[0] == 1].tolist()
    assert model_ids[: len(seam.ids)] == seam.ids, "the model's ids are kept as drawn"


def test_an_id_whose_overhang_is_not_what_follows_is_dropped(smollm2):
    """`>.` completes `</calc>` with `.`, which is not how `<result>` starts: the id leaves
    the turn and the appended text starts with the `>` it held."""
    turn = "<calc>2+2</calc>. So"
    ids = smollm2.hf.encode(turn, add_special_tokens=False)
    seam = cut_turn(smollm2, ids, ("</calc>",))
    assert seam.overhang == "."
    batch = episode(smollm2, tag_format(), Script(smollm2, [[turn, "<answer>4</answer>"]]), [calc])
    assert "<calc>2+2</calc><result>4</result><answer>4</answer>" in text_of(smollm2, batch, 0)
    model_ids = batch.tokens[0][batch.model_mask[0] == 1].tolist()
    assert model_ids[: len(seam.ids) - 1] == seam.ids[:-1]
    assert smollm2.hf.decode(model_ids[: len(seam.ids) - 1]) == "<calc>2+2</calc"
    assert text_of(smollm2, batch, 0, model=0).startswith("><result>4</result>")


def test_json_format_results_follow_the_end_of_turn_id(smollm2):
    """ChatML: the calling turn ends with `<|im_end|>`, a special id, so nothing merges; the
    results and the next generation prompt follow it exactly as the format renders them."""
    fmt = get_format("json")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    script = Script(smollm2, [[call, "It is 5."]], end=True)
    batch = episode(smollm2, fmt, script, [add])
    want = call + "<|im_end|>" + fmt.render_results([("add", "5")]) + "It is 5.<|im_end|>"
    assert text_of(smollm2, batch, 0) == want


def test_json_turn_cut_before_its_end_gets_the_end_from_the_format(smollm2):
    """A calling turn that did not sample `<|im_end|>` (cut at a user's stop string) has the
    format's end of turn written before the results, so the template's text is whole."""
    fmt = get_format("json")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    script = Script(smollm2, [[call, [smollm2.eos_ids[0]]]])
    batch = episode(smollm2, fmt, script, [add])
    want = call + "<|im_end|>" + fmt.render_results([("add", "5")]) + "<|im_end|>"
    assert text_of(smollm2, batch, 0) == want


def test_llama3_format_results_follow_eot(llama_like):
    fmt = get_format("llama3")
    call = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    script = Script(llama_like, [[call, "5"]], end=False)
    eot = llama_like.hf.convert_tokens_to_ids("<|eot_id|>")
    ids = llama_like.hf.encode(call, add_special_tokens=False)
    script.turns = [[[*ids, eot], [*llama_like.hf.encode("5", add_special_tokens=False), eot]]]
    batch = episode(llama_like, fmt, script, [add])
    want = call + "<|eot_id|>" + fmt.render_results([("add", "5")]) + "5<|eot_id|>"
    assert text_of(llama_like, batch, 0) == want


def test_results_that_overflow_the_budget_are_left_out_whole(smollm2):
    """TRL's rollback: the call's turn stays, its results are not appended (no cut tag), the
    episode ends and the call is counted as not run."""
    turn = "<calc>3*4</calc>"
    n = len(smollm2.hf.encode(turn, add_special_tokens=False))
    batch = episode(smollm2, tag_format(), Script(smollm2, [[turn, "x"]]), [calc], t=n + 3)
    assert text_of(smollm2, batch, 0) == turn
    assert batch.model_mask[0].sum() == batch.mask[0].sum() == n
    ep = batch.episodes[0]
    assert ep.tool_calls == 0 and sum(t.not_run for t in ep.turns) == 1


def test_a_call_in_the_last_allowed_turn_is_not_run_and_counted(smollm2):
    turn = "<calc>3*4</calc>"
    script = Script(smollm2, [[turn]])
    batch = episode(smollm2, tag_format(), script, [calc], limits=AgentLimits(max_turns=2))
    ep = batch.episodes[0]
    assert ep.num_turns == 2 and ep.tool_calls == 1 and ep.turns[-1].not_run == 1
    assert text_of(smollm2, batch, 0).count("<result>") == 1
