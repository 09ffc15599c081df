"""``python -m jaxgrpo.evaluate`` end to end: a tiny run's checkpoint against its base model,
the config.json round trip, the config's ``eval`` section and the flags over it, the judge prompt
from the config, and SmolLM2 on the GSM8K fixture (slow)."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.configs.base import JUDGE_PROMPT
from jaxgrpo.core import sharding
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.rewards import RewardSet
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.rl.learner import Learner
from jaxgrpo.run import evaluate as cli
from jaxgrpo.run.build import build_model, build_task, restore_params
from jaxgrpo.run.judge import judge_says_yes, make_judge
from jaxgrpo.settings.loading import load_config, run_config
from jaxgrpo.settings.schema import resolve_mesh_shape


def settings_of(argv, run_dir=None):
    """(config, settings) the way ``evaluate_runs`` builds them from a command line."""
    args = cli.parse_args(argv)
    cfg = run_config(args.config, run_dir, dict(args.overrides))
    return cfg, cli.eval_settings(cfg, args)


def test_cli_defaults_are_the_seed_study_settings():
    args = cli.parse_args(["--config", "gsm8k_hard", "--config.rl.beta=0.0"])
    assert args.overrides == [("rl.beta", 0.0)]
    _, settings = settings_of(["--config", "gsm8k_hard", "--config.rl.beta=0.0"])
    assert (settings.max_new_tokens, settings.temperature, settings.top_p) == (512, 0.6, 0.95)
    assert settings.num_samples == 8 and settings.split == "test"
    assert settings.judge_source == "" and settings.judge_prompt == JUDGE_PROMPT
    with pytest.raises(SystemExit):
        cli.parse_args(["--bogus"])


def test_flags_override_the_config_eval_section():
    argv = ["--config", "tiny", "--config.eval.num_samples=4", "--config.eval.top_p=0.5"]
    _, settings = settings_of(argv)
    assert (settings.num_samples, settings.top_p, settings.temperature) == (4, 0.5, 0.6)
    _, settings = settings_of([*argv, "--num_samples", "2", "--judge", "tiny"])
    assert (settings.num_samples, settings.top_p, settings.judge_source) == (2, 0.5, "tiny")
    bad = [
        ("--config.eval.judge_promt=x", r"unknown config key 'eval.judge_promt' \(did you mean"),
        ("--config.eval.num_samples='many'", "config key 'eval.num_samples'"),
        ("--config.eval.judge_prompt=no placeholder", "config key 'eval.judge_prompt'.*completion"),
        ("--config.eval.judge_prompt={completion} {answer}", r"'eval.judge_prompt'.*\['answer'\]"),
        ("--top_p=0", "config key 'eval.top_p'"),
    ]
    for arg, match in bad:
        with pytest.raises(ConfigError, match=match):
            settings_of(["--config", "tiny", arg])
    assert cli.main(["--config", "tiny", "--num_samples", "0"]) == 2


def test_held_out_set_is_the_runs_for_generated_tasks_and_the_split_for_data_sets():
    """Without --max_examples a generated task scores the run's `task.num_eval` prompts (it
    has no finite split: asking arithmetic for "all" used to draw forever); a data set, its
    whole split."""
    for config, n in (("format_copy", 64), ("arithmetic", 64)):
        cfg, settings = settings_of(["--config", config])
        assert cfg.task.num_eval == n
        _, examples = cli.task_examples(cfg, None, None, settings)
        assert len(examples) == n, config
    _, five = settings_of(["--config", "arithmetic", "--max_examples", "5"])
    assert cli.task_examples(cfg, None, None, five)[1] == examples[:5]
    # The GSM8K fixture's test split has 2 rows; a run that evaluated 1 still gets both.
    argv = ["--config", "gsm8k_hard", "--config.task.kwargs.source=fixture"]
    cfg, settings = settings_of([*argv, "--config.task.num_eval=1"])
    assert len(cli.task_examples(cfg, None, None, settings)[1]) == 2


def test_run_config_round_trips_config_json(tmp_path):
    cfg = load_config("gsm8k_curriculum", {"run_dir": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    again = run_config(None, str(tmp_path), {"rl.beta": 0.0})
    assert again.to_dict() == {**cfg.to_dict(), "rl": {**cfg.to_dict()["rl"], "beta": 0.0}}
    with pytest.raises(ConfigError, match="unknown config key 'eval.bogus'"):
        run_config(None, str(tmp_path), {"eval.bogus": 1})
    with pytest.raises(ConfigError, match="config key 'eval.top_p'"):
        run_config(None, str(tmp_path), {"eval.top_p": "high"})
    with pytest.raises(ConfigError, match="pass --config"):
        run_config(None, str(tmp_path / "nowhere"), {})


@pytest.mark.parametrize(
    ("reply", "yes"),
    [("Yes", True), (" yes.", True), ("**YES**, it does", True), ("No", False),
     ("Yesterday", False), ("not yes", False), ("", False)],
)  # fmt: skip
def test_judge_reads_the_first_word(reply, yes):
    assert judge_says_yes(reply) is yes


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run directory holding config.json and a step-3 checkpoint whose LoRA B is non-zero
    (so the trained policy differs from the base), written the way train.py writes them."""
    run_dir = str(tmp_path_factory.mktemp("tiny_run"))
    cfg = load_config("tiny", {"run_dir": run_dir})
    mesh = sharding.make_mesh(resolve_mesh_shape(cfg, jax.device_count()))
    model, tokenizer = build_model(cfg.model, cfg.seed, mesh)
    rewards = RewardSet([("format_copy", 1.0)])
    learner = Learner(cfg, model, tokenizer, build_task(cfg.task), rewards, mesh)
    state = learner.init_state()
    # Host-side noise: eager jax.random per leaf shape would compile one program per shape.
    rng = np.random.default_rng(7)

    def perturb(x):
        noisy = np.asarray(x) + 0.3 * rng.standard_normal(x.shape).astype(x.dtype)
        return jax.device_put(noisy, x.sharding)

    params = jax.tree.map(perturb, state.params)
    state = state.replace(params=params)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), every=1, keep=1)
    ckpt.save(3, state, {"step": 3, "data_cursor": 6}, force=True)
    ckpt.close()
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    return run_dir, jax.device_get(params), (model, tokenizer, mesh)


def test_checkpoint_params_are_restored_into_the_model(tiny_run):
    """The fixture's own model (still untrained: the learner perturbed a copy) gets the
    checkpoint's LoRA; building another tiny model would cost most of this test's time."""
    run_dir, saved, (model, tokenizer, mesh) = tiny_run
    cfg = run_config(None, run_dir, {})
    before = jax.device_get(nnx.state(model, nnx.LoRAParam))
    assert restore_params(cfg, model, tokenizer, run_dir, mesh) == 3
    restored = jax.device_get(nnx.state(model, nnx.LoRAParam))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(saved), strict=True)
    )


class RecordingTokenizer:
    """The real tokenizer, keeping the text of every prompt row it encodes (decoded back from
    the ids, i.e. what the model is given)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def encode_chat(self, messages, **kwargs):
        ids, mask = self.tokenizer.encode_chat(messages, **kwargs)
        for row, keep in zip(np.asarray(ids), np.asarray(mask), strict=True):
            self.prompts.append(self.tokenizer.decode(row[keep > 0]))
        return ids, mask

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_config_judge_prompt_reaches_the_judge(tiny_run):
    """``--config.eval.judge_prompt`` (on a run directory's config.json) is the text the judge
    model is prompted with, filled in per completion; the verdicts of a random model are not
    checked."""
    run_dir, _, (_, _, mesh) = tiny_run
    prompt = "JUDGE-TEST q={question} ref={reference} sol={completion} ok?"
    argv = ["--checkpoint", run_dir, f"--config.eval.judge_prompt={prompt}"]
    argv += ["--config.eval.judge_source=tiny", "--num_samples", "2", "--batch_size", "2"]
    cfg, settings = settings_of(argv, run_dir)
    assert settings.judge_prompt == prompt and settings.judge_source == "tiny"
    judge = make_judge(cfg, settings, mesh)
    judge.tokenizer = RecordingTokenizer(judge.tokenizer)
    examples = [{"messages": [{"role": "user", "content": "Copy this integer: 7"}], "answer": "7"}]
    verdicts = judge(examples, ["<answer>7</answer>", "8"])
    assert len(verdicts) == 2 and all(isinstance(v, bool) for v in verdicts)
    seen = judge.tokenizer.prompts
    assert len(seen) == 2, seen
    assert "JUDGE-TEST q=Copy this integer: 7 ref=7 sol=<answer>7</answer> ok?" in seen[0]
    assert "JUDGE-TEST q=Copy this integer: 7 ref=7 sol=8 ok?" in seen[1]
    assert "Does the student's solution" not in seen[0]  # the default prompt was replaced


def test_evaluate_checkpoint_and_base_side_by_side(tiny_run, tmp_path):
    run_dir, _, _ = tiny_run
    out = tmp_path / "eval.json"
    argv = ["--checkpoint", run_dir, "--base", "--num_samples", "3", "--max_examples", "2"]
    argv += ["--max_new_tokens", "6", "--batch_size", "2", "--out", str(out), "--judge", "tiny"]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    label = os.path.basename(run_dir)
    assert list(data["runs"]) == ["base", label]
    assert data["runs"][label]["step"] == 3 and data["runs"]["base"]["step"] == 0
    assert data["settings"]["num_samples"] == 3 and data["settings"]["judge_source"] == "tiny"
    for run in data["runs"].values():
        (task,) = run["tasks"].values()
        summary, records = task["summary"], task["records"]
        assert len(records) == 2 * 3 and summary["num_prompts"] == 2
        figures = {"strict_accuracy", "lenient_accuracy", "format_rate", "mean@3"}
        assert figures | {"pass@1", "pass@2", "pass@3"} <= set(summary)
        # The judge (a random tiny model here) gives one verdict per completion.
        assert all(isinstance(r["judge"], bool) for r in records) and 0 <= summary["judge"] <= 1
        assert all(1 <= r["length"] <= 6 for r in records)
    base_texts = [r["completion"] for r in data["runs"]["base"]["tasks"]["format_copy"]["records"]]
    run_texts = [r["completion"] for r in data["runs"][label]["tasks"]["format_copy"]["records"]]
    assert base_texts != run_texts, "same seed, different weights: the checkpoint was not used"
    table = (tmp_path / "eval.md").read_text().strip().split("\n")
    assert table[0].startswith("| strategy | format_copy strict |") and len(table) == 4


@pytest.mark.slow
def test_smollm2_on_gsm8k_fixture(tmp_path):
    """The real model, seed-study prompt, 2 prompts x 2 samples x 16 tokens on GSM8K and JEE
    (figures not asserted: 16 tokens rarely reach an answer; the pipeline, the records and the
    seed study's table layout are)."""
    out = tmp_path / "smol.json"
    argv = ["--config", "gsm8k_hard", "--model", "smollm2", "--data", "fixture"]
    argv += ["--max_examples", "2", "--num_samples", "2", "--max_new_tokens", "16"]
    argv += ["--batch_size", "2", "--out", str(out), "--config.model.lora_rank=0"]
    argv += ["--config.model.dtype='float32'", "--config.model.param_dtype='float32'"]
    argv += ["--tasks", "jeebench:fixture"]
    assert cli.main(argv) == 0
    tasks = json.loads(out.read_text())["runs"]["base"]["tasks"]
    assert list(tasks) == ["gsm8k", "jeebench"] and len(tasks["jeebench"]["records"]) == 4
    header = (tmp_path / "smol.md").read_text().split("\n")[0]
    assert header == "| strategy | GSM8K strict | GSM8K lenient | GSM8K pass@2 | JEE |"
    task = tasks["gsm8k"]
    texts = [r["completion"] for r in task["records"]]
    assert len(texts) == 4 and all(r["length"] <= 16 for r in task["records"])
    # A real instruct model writes words, not byte soup.
    assert sum(t.count(" ") for t in texts) >= 8, texts
    assert task["summary"]["lenient_accuracy"] >= task["summary"]["strict_accuracy"]


def test_a_run_with_tools_is_evaluated_on_episodes(tiny_run, tmp_path):
    """With the run's ``agent`` section, ``python -m jaxgrpo.evaluate`` samples episodes with
    the same tools and limits: each record carries its turns, the summary the agent metrics."""
    run_dir, _, _ = tiny_run
    out = tmp_path / "eval.json"
    argv = ["--checkpoint", run_dir, "--num_samples", "2", "--max_examples", "2"]
    argv += ["--max_new_tokens", "8", "--batch_size", "2", "--out", str(out)]
    argv += ["--config.agent.tools=('calc',)", "--config.agent.format=tag"]
    assert cli.main(argv) == 0
    (task,) = json.loads(out.read_text())["runs"][os.path.basename(run_dir)]["tasks"].values()
    assert len(task["records"]) == 4
    assert all(r["turns"] and "text" in r["turns"][0] for r in task["records"])
    for key in ("agent/tool_calls", "agent/turns", "agent/model_tokens", "agent/tool_tokens"):
        assert key in task["summary"], key
