"""A reward model named in ``rewards.functions``: its scores equal TRL's recipe run by hand with
transformers (the reward model's chat template over chat rows, plain concatenation otherwise,
right padding, no special tokens added), long texts keep their end, ``RewardSet`` hands it TRL's
conversational form, bad entries fail with a line naming the entry, and a training step and
``python -m jaxgrpo.evaluate`` report it as ``reward/<name>``."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_hf import llama_config  # noqa: E402

from jaxgrpo.core.errors import ConfigError  # noqa: E402
from jaxgrpo.models.tiny import TINY_VOCAB, tiny_tokenizer  # noqa: E402
from jaxgrpo.rewards import RewardSet  # noqa: E402
from jaxgrpo.rewards.reward_model import TIME_METRIC, is_model_source, load_reward_model  # noqa: E402
from jaxgrpo.run import build, train  # noqa: E402
from jaxgrpo.run import evaluate as evaluate_cli  # noqa: E402
from jaxgrpo.settings.loading import load_config  # noqa: E402

SYSTEM = {"role": "system", "content": "Reply with one <answer></answer> tag."}
CHATS = [
    [SYSTEM, {"role": "user", "content": "Copy this integer exactly: 4096"}],
    [{"role": "user", "content": "Copy this integer exactly: 12345"}],
    [SYSTEM, {"role": "user", "content": "Copy this integer exactly: 678"}],
]
ANSWERS = ["<answer>4096</answer>", "The answer is 42.", "<answer>678"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A random tiny Llama classifier saved with the tiny ChatML tokenizer (pad id 0)."""
    path = str(tmp_path_factory.mktemp("rm") / "tiny-rm")
    torch.manual_seed(0)
    config = llama_config(vocab_size=TINY_VOCAB, num_labels=1)
    ref = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    ref.save_pretrained(path)
    tiny_tokenizer().hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reward(rm_dir):
    return load_reward_model(rm_dir, batch_size=2)  # several batches and shapes per call


def trl_scores(rm_dir, texts):
    """TRL's ``_calculate_rewards`` for a model, step by step with transformers."""
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(rm_dir)
    ref.config.pad_token_id = tok.pad_token_id
    inputs = tok(
        text=texts,
        return_tensors="pt",
        padding=True,
        padding_side="right",
        add_special_tokens=False,
    )
    with torch.no_grad():
        return ref(**inputs).logits[:, 0].numpy()


def assert_close(a, b, rtol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(a - b).max() / np.abs(b).max()
    assert err <= rtol, f"relative score error {err:.2e} > {rtol}: {a} vs {b}"


def test_scores_equal_trls_on_chats_and_text(rm_dir, reward):
    tok = transformers.AutoTokenizer.from_pretrained(rm_dir)
    completions = [[{"role": "assistant", "content": a}] for a in ANSWERS]
    texts = [
        tok.apply_chat_template(p + c, tokenize=False)
        for p, c in zip(CHATS, completions, strict=True)
    ]
    logged = []
    chats = reward(CHATS, completions, log_metric=lambda k, v: logged.append((k, v)))
    assert_close(chats, trl_scores(rm_dir, texts))
    assert [k for k, _ in logged] == [TIME_METRIC] and logged[0][1] > 0
    # A completion given as a string in a chat is the assistant's message.
    assert reward(CHATS, ANSWERS) == chats
    prompts = ["Copy 4096: ", "Copy this integer exactly: 12345\n", "x"]
    text = reward(prompts, ANSWERS)
    assert_close(text, trl_scores(rm_dir, [p + a for p, a in zip(prompts, ANSWERS, strict=True)]))
    assert reward(["", "a"], ["", "b"])[0] is None, "a text of no token cannot be scored"


def test_long_texts_keep_their_end(rm_dir):
    short = load_reward_model(rm_dir, max_length=8)
    long_text = "Copy this integer exactly: 4096 <answer>4096</answer> and 12345"
    ids = short.tokenizer.hf.encode(long_text, add_special_tokens=False)
    assert len(ids) > 8
    tail = short.tokenizer.hf.decode(ids[-8:])
    assert short.encode(long_text) == ids[-8:]
    assert_close(short([long_text], [""]), trl_scores(rm_dir, [tail]))


def test_reward_set_hands_it_trls_conversational_form(reward):
    strings = ["rendered prompt", "another", "third"]
    rewards = RewardSet([(reward, 1.0)])
    assert rewards.terms[0].name == "tiny-rm" and not rewards.terms[0].builtin
    _, per_fn, _ = rewards(strings, ANSWERS, prompt_messages=CHATS)
    np.testing.assert_allclose(per_fn["tiny-rm"], reward(CHATS, ANSWERS), rtol=1e-6)
    _, per_fn, _ = rewards(strings, ANSWERS)
    np.testing.assert_allclose(per_fn["tiny-rm"], reward(strings, ANSWERS), rtol=1e-6)
    assert TIME_METRIC in rewards.logged_metrics


def test_config_entries_name_the_problem(rm_dir, tmp_path):
    assert is_model_source(rm_dir) and is_model_source("org/name")
    assert not is_model_source("format_copy") and not is_model_source("my_pkg.rewards.fn")
    ok = load_config("tiny", {"rewards.functions": ((rm_dir, 1.0, {"batch_size": 4}),)})
    assert ok.rewards.functions[0][2] == {"batch_size": 4}
    with pytest.raises(ConfigError, match=r"'rewards.functions\[0\]'.*takes \['batch_size'"):
        load_config("tiny", {"rewards.functions": ((rm_dir, 1.0, {"batch_sz": 4}),)})
    with pytest.raises(ConfigError, match=r"'rewards.functions\[0\]'.*max_length must be"):
        load_config("tiny", {"rewards.functions": ((rm_dir, 1.0, {"max_length": 0}),)})
    missing = str(tmp_path / "no_rm")
    with pytest.raises(ConfigError, match=r"'rewards.functions\[1\]'.*no_rm does not exist"):
        build.bind_model_rewards([("format_copy", 1.0), (missing, 1.0)], None, None)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_training_step_and_evaluation_report_it(rm_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    rewards = ((rm_dir, 1.0, {"batch_size": 8}), ("format_copy", 0.5))
    cfg = load_config(
        "tiny",
        {"run_dir": run_dir, "steps": 1, "rewards.functions": rewards, "checkpoint.every": 0},
    )
    train.run(cfg)
    step = next(r for r in _metrics(run_dir) if "reward/tiny-rm/mean" in r)
    assert np.isfinite(step["reward/tiny-rm/mean"]) and step["reward/tiny-rm/failed_frac"] == 0
    assert 0 < step["time/reward_model"] <= step["time/rewards"]  # a part of the rewards phase
    argv = ["--config", "tiny", "--max_examples", "2", "--num_samples", "1"]
    argv += ["--max_new_tokens", "4", "--out", str(tmp_path / "eval.json")]
    argv += [f"--config.rewards.functions=(('{rm_dir}', 1.0),)"]
    assert evaluate_cli.main(argv) == 0
    with open(tmp_path / "eval.json", encoding="utf-8") as f:
        summary = json.load(f)["runs"]
    summary = next(iter(summary.values()))["tasks"]
    figures = next(iter(summary.values()))["summary"]
    assert np.isfinite(figures["reward/tiny-rm/mean"])
