"""MetricsLogger sinks, resume truncation, process gating, progress text and dead-run warnings."""

import importlib.util
import json
import math

import numpy as np
import pytest

from jaxgrpo.rl import run_log as jlog


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_jsonl_tensorboard_and_samples(tmp_path):
    logger = jlog.MetricsLogger(str(tmp_path), 0, tensorboard=True)
    logger.log(1, {"reward/mean": np.float32(0.5), "kl/mean": np.array([0.25]), "bad": math.nan})
    logger.log(2, {"reward/mean": 0.75, "note": "x"})
    logger.log_samples(2, [{"prompt": "p", "completion": "c", "rewards": {"f": np.float32(1)}}])
    logger.close()
    rows = _read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["kl/mean"] == 0.25
    assert rows[0]["bad"] is None, "NaN is written as null so the file is strict JSON"
    assert _read(tmp_path / "samples.jsonl") == [
        {"step": 2, "prompt": "p", "completion": "c", "rewards": {"f": 1.0}}
    ]
    events = list((tmp_path / "tensorboard").iterdir())
    assert events and events[0].stat().st_size > 0
    with pytest.raises(ValueError, match="scalars"):
        jlog.MetricsLogger(str(tmp_path / "v"), 0, tensorboard=False).log(1, {"v": np.ones(3)})


def test_resume_drops_rerun_steps_and_only_process_zero_writes(tmp_path):
    logger = jlog.MetricsLogger(str(tmp_path), 0, tensorboard=False)
    for step in range(1, 5):
        logger.log(step, {"reward/mean": step})
        logger.log_samples(step, [{"completion": str(step)}])
    logger.close()
    resumed = jlog.MetricsLogger(str(tmp_path), 0, tensorboard=False, resume_step=2)
    resumed.log(3, {"reward/mean": 30})
    resumed.close()
    assert [(r["step"], r["reward/mean"]) for r in _read(tmp_path / "metrics.jsonl")] == [
        (1, 1),
        (2, 2),
        (3, 30),
    ]
    assert [r["step"] for r in _read(tmp_path / "samples.jsonl")] == [1, 2]

    other = jlog.MetricsLogger(str(tmp_path / "p1"), 1, tensorboard=True)
    other.log(1, {"reward/mean": 1.0})
    other.log_samples(1, [{"completion": "c"}])
    other.close()
    assert not (tmp_path / "p1").exists(), "process 1 must not write anything"


def test_progress_text_and_dead_run_warnings(capsys):
    text = jlog.ProgressBar.describe(
        {
            "reward/mean": 0.5,
            "strict_accuracy": 0.25,
            "kl/mean": 0.001,
            "time/sampling": 2.0,
            "time/update": 1.5,
        }
    )
    assert text == "reward=0.500 acc=0.25 kl=0.0010 s=3.5 (sample 2.0|update 1.5)"
    times = {"time/sampling": 2.0, "time/reference": 0.5, "time/update": 1.0}
    text = jlog.ProgressBar.describe(times)
    assert text == "s=3.5 (sample 2.0|ref 0.5|update 1.0)"
    bar = jlog.ProgressBar(total=3, enabled=False)
    bar.update(1, {})  # disabled bars accept updates
    bar.close()

    jlog._WARNED.clear()
    healthy = {"completion/truncated_frac": 0.5, "reward/std": 0.3}
    assert jlog.check_dead_run(1, healthy) == []
    dead = {"completion/truncated_frac": 1.0, "reward/std": 0.0}
    assert jlog.check_dead_run(2, dead) == ["dead_run/truncated", "dead_run/constant_reward"]
    assert jlog.check_dead_run(3, dead) == [], "each warning fires once"
    err = capsys.readouterr().err
    assert err.count("warning:") == 2 and "every completion was truncated" in err
    assert err.count("\n") == 2, f"each warning is one line, printed once: {err!r}"

    solved = {"completion/truncated_frac": 0.0, "reward/std": 0.0, "strict_accuracy": 1.0}
    assert jlog.check_dead_run(4, solved) == ["dead_run/solved"]
    out = capsys.readouterr()
    assert "solved" in out.out and "does not move" not in out.out + out.err

    jlog._WARNED.clear()
    distilling = {"reward/std": 0.0, "strict_accuracy": 0.0, "distill_reverse_kl": 0.4}
    assert jlog.check_dead_run(5, distilling) == [], "the teacher's term is a signal"
    text = jlog.ProgressBar.describe({"time/sampling": 2.0, "time/teacher": 0.5})
    assert text == "s=2.5 (sample 2.0|teacher 0.5)"


def test_wandb_enabled_but_not_installed_warns_and_keeps_logging(tmp_path, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here; this checks the missing-package path")
    jlog._WARNED.clear()
    logger = jlog.MetricsLogger(str(tmp_path), 0, tensorboard=False, wandb=True)
    logger.log(1, {"reward/mean": 1.0})
    logger.close()
    assert "wandb is not installed" in capsys.readouterr().err
    assert _read(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 1.0
