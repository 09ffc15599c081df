"""``python -m jaxgrpo.study``: arms trained and evaluated end to end on the tiny config, the
table equal to the evaluation files, and a bad arm override refused before any training."""

import json
import os
import re
import subprocess
import sys

import pytest

from jaxgrpo.core.errors import UserError
from jaxgrpo.run import study as study_lib
from jaxgrpo.run import study_results

STUDY = """
from jaxgrpo.run.study import Arm, Study


def get_study():
    return Study(
        name="two_arms",
        base="tiny",
        overrides={"steps": 2, "checkpoint.every": 1, "eval.num_samples": 2}
        if {BAD_EVAL} else {"steps": 2, "checkpoint.every": 1},
        evaluate_base=False,
        arms=[
            Arm("grpo", {"rl.loss_type": "grpo"}, note="GRPO"),
            Arm("dr_grpo", {"rl.loss_type": "dr_grpo", {BAD_KEY}: 0.0}),
        ],
    )
"""


def _write(tmp_path, bad_key="'rl.beta'", bad_eval=False):
    path = tmp_path / "study.py"
    text = STUDY.replace("{BAD_KEY}", bad_key).replace("{BAD_EVAL}", str(bad_eval))
    path.write_text(text)
    return str(path)


def test_bad_arm_override_names_arm_and_key_before_training(tmp_path):
    study = study_lib.load_study(_write(tmp_path, bad_key="'rl.betaa'"))
    with pytest.raises(UserError, match=r"arm 'dr_grpo'.*rl\.betaa"):
        study_lib.run_study(study, str(tmp_path / "out"), say=lambda *_: None)
    assert not (tmp_path / "out" / "arms").exists()  # nothing trained


def test_cli_names_a_bad_arm_override_in_one_line(tmp_path):
    """`python -m jaxgrpo.study` from another directory: the study file's `Study` is accepted
    (the module run as __main__ once rejected it as "Study, not a Study") and a bad override
    fails in one line naming the arm and the key, with nothing trained."""
    path, out = _write(tmp_path, bad_key="'rl.betaa'"), tmp_path / "out"
    cmd = [sys.executable, "-m", "jaxgrpo.study", "--config", path, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1, proc.stderr
    assert "arm 'dr_grpo'" in errors[0] and "rl.betaa" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (out / "arms").exists()


def test_arm_may_not_change_the_protocol(tmp_path):
    with pytest.raises(UserError, match=r"eval\.num_samples"):
        study_lib.load_study(_write(tmp_path, bad_eval=True))


def test_only_names_unknown_arm(tmp_path):
    study = study_lib.load_study(_write(tmp_path))
    with pytest.raises(UserError, match=r"unknown arm\(s\) \['nope'\]"):
        study_lib.select(study, "grpo,nope")


@pytest.mark.slow
def test_two_arm_study_end_to_end_then_resume_skips_finished(tmp_path):
    path, out = _write(tmp_path), str(tmp_path / "out")
    lines: list[str] = []
    study_lib.main(["--config", path, "--out", out, "--only", "grpo"])
    grpo_metrics = open(os.path.join(out, "arms", "grpo", "metrics.jsonl")).read()
    results = study_lib.run_study(study_lib.load_study(path), out, say=lines.append)
    assert any("grpo: already trained (2 steps), skipped" in line for line in lines)
    assert open(os.path.join(out, "arms", "grpo", "metrics.jsonl")).read() == grpo_metrics
    assert sorted(os.listdir(os.path.join(out, "arms"))) == ["dr_grpo", "grpo"]
    table = open(os.path.join(out, "results.md")).read()
    rows = [r for r in table.splitlines() if re.match(r"\| (grpo|dr_grpo) \|", r)]
    assert len(rows) == 2
    for row in rows:
        label = row.split("|")[1].strip()
        saved = json.load(open(os.path.join(out, "arms", label, "eval_test.json")))
        summary = next(iter(saved["runs"][label]["tasks"].values()))["summary"]
        header = next(r for r in table.splitlines() if r.startswith("| arm |"))
        names = [c.strip() for c in header.split("|")[2:-1]]
        cells = dict(zip(names, [c.strip() for c in row.split("|")[2:-1]], strict=True))
        assert cells["strict %"] == f"{100 * summary['strict_accuracy']:.1f}"
        assert cells["lenient %"] == f"{100 * summary['lenient_accuracy']:.1f}"
        assert cells["format %"] == f"{100 * summary['format_rate']:.1f}"
        k = summary["num_samples"]
        assert cells[f"pass@{k} %"] == f"{100 * summary[f'pass@{k}']:.1f}"
        se = results["arms"][label]["strict_se"]
        assert cells["s.e."] == f"{100 * se:.1f}" and 0 <= se <= 0.5
        zero = results["arms"][label]["signal"]["zero_adv_groups"]
        assert cells["zero-adv groups %"] == f"{100 * zero:.0f}" and 0 <= zero <= 1
        same = json.dumps(results["arms"][label]["summary"], sort_keys=True)
        assert same == json.dumps(summary, sort_keys=True)  # NaN lengths compare as text
    assert os.path.exists(os.path.join(out, "plots", "heldout_accuracy.png"))


@pytest.mark.parametrize("name", ["reward_structure_mini", "format_copy_algorithms"])
def test_shipped_studies_validate_every_arm(name, tmp_path):
    study = study_lib.load_study(name)
    configs = study_lib.arm_configs(study, str(tmp_path))
    assert list(configs) == [a.label for a in study.arms]
    assert len({c.steps for c in configs.values()}) == 1  # same budget for every arm


def test_tool_use_study_arms_and_its_table_columns(tmp_path):
    """tool_use_mini's arms: the same budget for the trained ones, untrained arms with and
    without the tool, the calculator only where named; a table of arms with tools gets the
    per-episode columns and the calls over training, with "-" for an arm without tools."""
    study = study_lib.load_study("tool_use_mini")
    configs = study_lib.arm_configs(study, str(tmp_path))
    steps = {label: c.steps for label, c in configs.items()}
    trained = ["no_tool", "calculator", "words_no_tool", "words_calculator"]
    assert steps == {"base_no_tool": 0, "base_calculator": 0} | {a: 16 for a in trained}
    assert [label for label, c in configs.items() if c.agent.tools == ("calc",)] == [
        "base_calculator",
        "calculator",
        "words_calculator",
    ]
    assert {c.task.kwargs["kind"] for c in configs.values()} == {"expression", "word"}
    summary = {"num_prompts": 4, "pass@2": 0.5, "doom_loop": 0.0}
    summary |= {"strict_accuracy": 0.5, "lenient_accuracy": 0.5, "format_rate": 1.0}
    summary |= {"length_correct": {"mean": 10.0}, "length_incorrect": {"mean": 12.0}}
    signal = {"zero_adv_groups": 0.25, "calls_first": 0.1, "calls_last": 0.9}
    rows = {
        "no_tool": {"summary": summary, "strict_se": 0.05, "signal": {"zero_adv_groups": 1.0}},
        "calculator": {
            "summary": {**summary, "agent/tool_calls": 0.75, "agent/turns": 1.5},
            "strict_se": 0.04,
            "signal": signal,
        },
    }
    protocol = {"num_samples": 2, "max_new_tokens": 8, "temperature": 0.6, "top_p": 0.95}
    table = study_results.results_markdown(study, rows, protocol)
    head = "| arm | strict % | s.e. | tool calls / episode | turns | tool errors / episode |"
    assert head + " zero-adv groups % | train calls / episode, first -> last |" in table
    assert "| calculator | 50.0 | 4.0 | 0.75 | 1.50 | - | 25 | 0.10 -> 0.90 |" in table
    assert "| no_tool | 50.0 | 5.0 | - | - | - | 100 | - |" in table
