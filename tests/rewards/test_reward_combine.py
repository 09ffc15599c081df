"""Registry, curricula, hybrid rewards and RewardSet (weights, None handling, errors)."""

import asyncio
import importlib.util
import logging
import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxgrpo.data.base import CHAT_ROW
from jaxgrpo.rewards import (
    REWARDS,
    Curriculum,
    RewardError,
    RewardSet,
    TrainerState,
    get_reward,
    reward_inputs,
    reward_name,
)
from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.hybrid import embedding_bleu, hard_soft
from jaxgrpo.rewards.math import exact_answer


def always_half(prompts, completions, **_):
    """A user reward importable by dotted path."""
    return [0.5] * len(completions)


def length_reward(prompts, completions, **_):
    """``len(c) / 10``: a deterministic stand-in encoder score for composition tests."""
    return [len(c) / 10 for c in completions]


def test_registry_names_dotted_paths_and_unknown_name():
    for name in (
        "exact_answer",
        "format",
        "format_copy",
        "bleu",
        "embedding",
        "perplexity",
        "embedding_bleu",
        "hard_soft",
        "sonnet_form",
        "code_tests",
        "length_penalty",
    ):
        assert callable(REWARDS[name]) and get_reward(name) is REWARDS[name]
    assert get_reward(f"{__name__}.always_half")(["p"], ["c"]) == [0.5]
    assert get_reward(f"{__name__}:always_half") is always_half
    with pytest.raises(ValueError, match="exact_answer"):  # the message lists known names
        get_reward("exact_anwser")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module.fn")
    bound = get_reward("length_penalty", max_length=10, cache_length=5)
    assert bound(["p"], ["c"], completion_lengths=[10]) == [-1.0]
    assert reward_name(bound) == "length_penalty" and reward_name(always_half) == "always_half"


@pytest.mark.parametrize(
    "spec, steps, expected",
    [
        (0.3, [0, 10**6], [0.3, 0.3]),
        ({"kind": "constant", "value": 2.0}, [5], [2.0]),
        (
            {"kind": "linear", "start": 1.0, "end": 0.0, "start_step": 10, "end_step": 110},
            [0, 10, 35, 60, 110, 500],
            [1.0, 1.0, 0.75, 0.5, 0.0, 0.0],
        ),
        (
            {"kind": "step", "start": 0.0, "end": 1.0, "end_step": 100},
            [0, 99, 100, 101],
            [0.0, 0.0, 1.0, 1.0],
        ),
        # cos(pi/4) = sqrt(2)/2, so at a quarter of the way the weight is (1 + sqrt(2)/2) / 2.
        (
            Curriculum(kind="cosine", start=1.0, end=0.0, start_step=0, end_step=100),
            [0, 25, 50, 100, 200],
            [1.0, (1 + math.sqrt(2) / 2) / 2, 0.5, 0.0, 0.0],
        ),
    ],
)
def test_curricula_values_at_given_steps(spec, steps, expected):
    curriculum = Curriculum.from_spec(spec)
    assert [curriculum(s) for s in steps] == pytest.approx(expected, abs=1e-12)


def test_curriculum_rejects_bad_specs():
    with pytest.raises(ValueError, match="known"):
        Curriculum(kind="exponential")
    with pytest.raises(ValueError, match="end_step"):
        Curriculum(kind="linear", start_step=5, end_step=5)
    with pytest.raises(ValueError, match="unknown curriculum fields"):
        Curriculum.from_spec({"kind": "step", "switch": 3})


def test_reward_set_weights_total_and_none_as_nan():
    def maybe(prompts, completions, **_):
        return [None if c == "skip" else 1.0 for c in completions]

    rewards = RewardSet(
        [("exact_answer", {"kind": "step", "start": 0.0, "end": 2.0, "end_step": 10}), (maybe, 0.5)]
    )
    completions = ["<answer>3</answer>", "skip", "<answer>4</answer>"]
    columns = {"answer": ["3", "3", "3"]}
    total, per_fn, weights = rewards(["p"] * 3, completions, columns, step=10)
    assert weights == {"exact_answer": 2.0, "maybe": 0.5}
    np.testing.assert_array_equal(per_fn["exact_answer"], np.float32([1, 0, 0]))
    np.testing.assert_array_equal(per_fn["maybe"], np.float32([1, np.nan, 1]))
    # None counts as weight 0 for its sample: 2*1 + 0.5*1, 2*0 + (none), 2*0 + 0.5*1.
    np.testing.assert_allclose(total, np.float32([2.5, 0.0, 0.5]))
    assert total.dtype == np.float32 and total.shape == (3,)
    total0, _, weights0 = rewards(["p"] * 3, completions, columns, step=0)
    assert weights0["exact_answer"] == 0.0
    np.testing.assert_allclose(total0, np.float32([0.5, 0.0, 0.5]))
    all_none, _, _ = RewardSet([(maybe, 1.0)])(["p"], ["skip"], {}, step=0)
    assert np.isnan(all_none).all()


def test_reward_set_raising_reward_scores_none_and_warns_once(caplog):
    def fragile(prompts, completions, **_):
        if any("boom" in c for c in completions):
            raise ZeroDivisionError("boom")
        return [1.0] * len(completions)

    rewards = RewardSet([(fragile, 1.0), ("format", 1.0)])
    completions = ["<answer>1</answer>", "boom here", "<answer>2</answer>"]
    with caplog.at_level(logging.WARNING):
        total, per_fn, _ = rewards(["p"] * 3, completions, {}, step=0)
        rewards(["p"] * 3, completions, {}, step=1)
    np.testing.assert_array_equal(per_fn["fragile"], np.float32([1, np.nan, 1]))
    np.testing.assert_allclose(total, np.float32([2.0, 0.0, 2.0]))
    warnings = [r for r in caplog.records if "fragile" in r.getMessage()]
    assert len(warnings) == 1, "one warning per function, naming it and the sample"
    assert "boom here" in warnings[0].getMessage() and "Sample 1" in warnings[0].getMessage()
    assert rewards.error_counts == {"fragile": 2}
    with pytest.raises(RewardError, match="fragile"):
        RewardSet([(fragile, 1.0)], on_error="raise")(["p"], ["boom"], {}, step=0)


def test_reward_set_wrong_length_names_the_function():
    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(ValueError, match="short.*1 values for 2"):
        RewardSet([(short, 1.0)])(["p"] * 2, ["a", "b"], {}, step=0)
    with pytest.raises(ValueError, match="column 'answer'"):
        RewardSet([("exact_answer", 1.0)])(["p"] * 2, ["a", "b"], {"answer": ["1"]}, step=0)
    with pytest.raises(ValueError, match="on_error"):
        RewardSet([("format", 1.0)], on_error="ignore")


def test_embedding_bleu_and_hard_soft_formulas():
    completions = ["<think>two plus two is four</think><answer>4</answer>", "<answer>5</answer>"]
    refs = ["two plus two is four", "two plus two is four"]
    cos = length_reward(None, completions)  # the embedding fn sees the raw completions
    got = embedding_bleu(["p"] * 2, completions, reference=refs, embedding_fn=length_reward)
    want_bleu = bleu(["p"] * 2, completions, reference=refs)
    assert got == pytest.approx([0.7 * c + 0.3 * b for c, b in zip(cos, want_bleu, strict=True)])
    hard = exact_answer(["p"] * 2, completions, answer=["4", "4"])
    got = hard_soft(
        ["p"] * 2,
        completions,
        answer=["4", "4"],
        reference=refs,
        hard_weight=0.8,
        embedding_fn=length_reward,
    )
    soft = length_reward(None, completions)
    assert hard == [1.0, 0.0]
    assert got == pytest.approx([0.8 * h + 0.2 * s for h, s in zip(hard, soft, strict=True)])
    assert hard_soft(["p"], ["x"], answer=[None], reference=["r"], embedding_fn=length_reward) == [
        None
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("jaxgrpo.rewards.embedding") is None,
    reason="jaxgrpo.rewards.embedding (tasks engineer) not present yet",
)
def test_hybrids_with_the_default_encoder():
    """Identical reasoning and reference: cos = 1 and BLEU = 1, so both hybrids give 1."""
    completion, ref = (
        "<think>the cat sat on the mat</think><answer>1</answer>",
        "the cat sat on the mat",
    )
    got = REWARDS["embedding_bleu"](["p"], [completion], reference=[ref])
    assert got[0] == pytest.approx(1.0, abs=1e-3)
    got = REWARDS["hard_soft"](["p"], [completion], answer=["1"], reference=[ref])
    assert got[0] == pytest.approx(1.0, abs=1e-3)


def test_importing_the_registry_loads_no_model():
    heavy = ("torch", "jaxgrpo.models.encoder", "jaxgrpo.rewards.perplexity")
    code = f"import sys, jaxgrpo.rewards; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# TRL's signature: functions exactly as a TRL GRPOTrainer user writes them.


def reward_len(completions, **kwargs):
    """TRL docs' standard-format example: prefer completions near 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """TRL docs' conversational-format example."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def user_turn_and_ids(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Reads every TRL keyword: conversational prompts, token ids, the step, columns, loggers."""
    kwargs["log_metric"]("mean_ids", sum(map(len, completion_ids)) / len(completion_ids))
    kwargs["log_extra"]("user", [p[-1]["content"] for p in prompts])
    scale = trainer_state.global_step / trainer_state.max_steps
    return [
        scale * len(ids) + (1.0 if a in c[0]["content"] else 0.0)
        for ids, c, a in zip(completion_ids, completions, kwargs["answer"], strict=True)
    ]


TRL_BATCH = {
    "completions": ["<think>a</think><answer>4</answer>", "just 5"],
    "messages": [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "2+3?"}]],
    "columns": {
        "answer": ["4", "5"],
        "completion_ids": [[5, 6, 7], [8]],
        "completion_lengths": [3, 1],
    },
}


def test_trl_standard_function_gets_strings_and_every_trl_keyword():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kw):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, kw=kw)
        seen["state"] = trainer_state
        return [0.0] * len(completions)

    b = TRL_BATCH
    rewards = RewardSet([(reward_len, 1.0), (spy, 1.0)])
    _, per_fn, _ = rewards(["rendered 1", "rendered 2"], b["completions"], b["columns"], 7)
    np.testing.assert_array_equal(per_fn["reward_len"], np.float32([-14, -14]))
    assert seen["prompts"] == ["rendered 1", "rendered 2"]
    assert seen["completions"] == b["completions"] and seen["ids"] == [[5, 6, 7], [8]]
    assert seen["state"] == TrainerState(global_step=7, max_steps=0)
    assert set(seen["kw"]) == {"answer", "completion_lengths"}


def test_trl_conversational_function_runs_unchanged_and_builtins_keep_strings():
    b = TRL_BATCH
    rewards = RewardSet(
        [(format_reward_func, 1.0), (user_turn_and_ids, 1.0), ("exact_answer", 1.0)]
    )
    _, per_fn, _ = rewards(
        ["rendered 1", "rendered 2"],
        b["completions"],
        b["columns"],
        5,
        prompt_messages=b["messages"],
        max_steps=10,
    )
    np.testing.assert_array_equal(per_fn["format_reward_func"], np.float32([1, 0]))
    # 0.5 * len(ids) + (holds the answer): 1.5 + 1, 0.5 + 1.
    np.testing.assert_allclose(per_fn["user_turn_and_ids"], np.float32([2.5, 1.5]))
    np.testing.assert_array_equal(per_fn["exact_answer"], np.float32([1, 0]))
    assert rewards.logged_metrics == {"mean_ids": [2.0]}
    assert rewards.logged_extra == {"user": ["2+2?", "2+3?"]}


def test_reward_failing_every_sample_stops_after_max_failed_steps():
    def always_raises(prompts, completions, **_):
        raise KeyError("no column 'solution'")

    rewards = RewardSet([(always_raises, 1.0), ("format", 1.0)])
    for step in range(2):  # two rounds of one step (dynamic sampling) count once
        rewards(["p"], ["<answer>1</answer>"], {}, step, max_failed_steps=3)
        rewards(["p"], ["<answer>1</answer>"], {}, step, max_failed_steps=3)
    with pytest.raises(RewardError) as info:
        rewards(["p"], ["<answer>1</answer>"], {}, 2, max_failed_steps=3)
    message = str(info.value)
    assert "'always_raises'" in message and "3 consecutive steps" in message
    assert "no column 'solution'" in message and "<answer>1</answer>" in message
    assert "rewards.conversational=True" in message, "hints at TRL's conversational format"
    assert "\n" not in message, "one line for the command line"


def test_reward_failing_some_samples_or_some_steps_does_not_stop():
    def none_for_b(prompts, completions, **_):
        return [None if c == "b" else 1.0 for c in completions]

    rewards = RewardSet([(none_for_b, 1.0)])
    for step in range(5):
        rewards(["p"] * 2, ["a", "b"], {}, step, max_failed_steps=1)  # half fails: fine
    streak = RewardSet([(none_for_b, 1.0)])
    for step in range(6):  # all-None steps, interrupted by a scored one, never reach 3
        completions = ["a"] if step % 3 == 2 else ["b"]
        streak(["p"], completions, {}, step, max_failed_steps=3)
    streak(["p"], ["b"], {}, 6, max_failed_steps=3)
    streak(["p"], ["b"], {}, 7, max_failed_steps=3)
    with pytest.raises(RewardError, match="none_for_b.*sample 0 returned None.*'b'"):
        streak(["p"], ["b"], {}, 8, max_failed_steps=3)
    # Evaluation passes no limit: never an error.
    for step in range(5):
        RewardSet([(none_for_b, 1.0)])(["p"], ["b"], {}, step)


def test_a_call_past_its_time_limit_scores_none_and_counts_toward_max_failed_steps():
    """A call past ``timeout_s`` is interrupted: its samples score None (the other function
    still scores), and like any failure it counts toward ``max_failed_steps``."""

    def hangs(prompts, completions, **_):
        time.sleep(60)

    rewards = RewardSet([(hangs, 1.0), ("format", 1.0)], timeout_s=0.5)
    t0 = time.perf_counter()
    total, per_fn, _ = rewards(["p"], ["<answer>1</answer>"], {}, 0, max_failed_steps=2)
    assert time.perf_counter() - t0 < 5.0, "the limit stopped the call"
    assert np.isnan(per_fn["hangs"]).all() and per_fn["format"][0] == 1.0
    assert np.isfinite(total).all() and rewards.error_counts["hangs"] == 1
    with pytest.raises(RewardError, match=r"'hangs' failed on every sample of 2 .*0\.5 s") as info:
        rewards(["p"], ["<answer>1</answer>"], {}, 1, max_failed_steps=2)
    assert "conversational" not in str(info.value), "no hint about the data format"


async def judge_slowly(prompts, completions, **_):
    """An async reward (an LLM judge's stand-in): waits, then scores the length."""
    await asyncio.sleep(0.6)
    return [float(len(c)) for c in completions]


class AsyncJudge:
    """A callable instance whose ``__call__`` is a coroutine (TRL awaits these too)."""

    __name__ = "async_judge"

    async def __call__(self, prompts, completions, answer, **_):
        await asyncio.sleep(0.6)
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer, strict=True)]


def test_async_reward_functions_are_awaited_together():
    rewards = RewardSet([(judge_slowly, 1.0), (AsyncJudge(), 1.0), (length_reward, 1.0)])
    t0 = time.perf_counter()
    total, per_fn, _ = rewards(["p"] * 2, ["ab 4", "c"], {"answer": ["4", "5"]}, 0)
    assert time.perf_counter() - t0 < 1.1, "the two 0.6 s judges ran at once"
    np.testing.assert_array_equal(per_fn["judge_slowly"], np.float32([4, 1]))
    np.testing.assert_array_equal(per_fn["async_judge"], np.float32([1, 0]))
    np.testing.assert_allclose(total, np.float32([4 + 1 + 0.4, 1 + 0 + 0.1]))


def test_async_reward_limits_and_errors_as_for_sync_ones():
    async def waits_forever(prompts, completions, **_):
        await asyncio.sleep(60)

    async def blocks_the_loop(prompts, completions, **_):
        time.sleep(2.0)  # never awaits: only the caller's wait can end
        return [1.0] * len(completions)

    async def fails_on_b(prompts, completions, **_):
        if "b" in completions:
            raise ValueError("cannot judge b")
        return [2.0] * len(completions)

    rewards = RewardSet([(waits_forever, 1.0), (fails_on_b, 1.0), ("format", 1.0)], timeout_s=0.5)
    t0 = time.perf_counter()
    _, per_fn, _ = rewards(["p"] * 2, ["a", "b"], {}, 0)
    assert time.perf_counter() - t0 < 1.5, "rewards.timeout_s holds for async functions"
    assert np.isnan(per_fn["waits_forever"]).all()
    assert per_fn["fails_on_b"][0] == 2.0 and np.isnan(per_fn["fails_on_b"][1])
    assert rewards.error_counts == {"waits_forever": 2, "fails_on_b": 1}
    # One that never awaits holds the loop: the wait for it ends past its limit all the same.
    blocked = RewardSet([(blocks_the_loop, 1.0), ("format", 1.0)], timeout_s=0.5)
    t0 = time.perf_counter()
    _, per_fn, _ = blocked(["p"], ["<answer>1</answer>"], {}, 0)
    assert time.perf_counter() - t0 < 1.9
    assert np.isnan(per_fn["blocks_the_loop"]).all() and per_fn["format"][0] == 1.0
    time.sleep(0.6)  # the loop frees itself for what follows
    with pytest.raises(RewardError, match="'fails_on_b' raised: ValueError"):
        RewardSet([(fails_on_b, 1.0)], on_error="raise")(["p"], ["b"], {}, 0)


def _chats(prompts, completions, **_):
    """A TRL conversational function: fails on strings."""
    return [
        float(c[-1]["content"] == "4" and p[-1]["role"] == "user")
        for p, c in zip(prompts, completions, strict=True)
    ]


@pytest.mark.parametrize(
    "conversational, chat_rows, gets_messages",
    [("auto", True, True), ("auto", False, False), (True, False, True), (False, True, False)],
)
def test_conversational_follows_the_data_as_trl_does(conversational, chat_rows, gets_messages):
    """``"auto"``: message lists where the data's rows were chats (``CHAT_ROW``), strings
    where the task built the prompt from text; True/False force one form."""
    example = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    if chat_rows:
        example[CHAT_ROW] = True
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, keys=set(kwargs))
        return [0.0] * len(completions)

    inputs = reward_inputs([example], 1, ["<rendered>"], ["4"], [[7]])
    RewardSet([(spy, 1.0), ("exact_answer", 1.0)], conversational=conversational).score(inputs)
    if gets_messages:
        assert seen["prompts"] == [example["messages"]]
        assert seen["completions"] == [[{"role": "assistant", "content": "4"}]]
    else:
        assert seen["prompts"] == ["<rendered>"] and seen["completions"] == ["4"]
    assert CHAT_ROW not in seen["keys"] and "model_completions" in seen["keys"]
    with pytest.raises(ValueError, match="conversational must be True, False or 'auto'"):
        RewardSet([(spy, 1.0)], conversational="yes")
