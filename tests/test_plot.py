"""``python -m jaxgrpo.plot``: one PNG per logged quantity, runs overlaid, missing ones skipped."""

import json

import numpy as np
import pytest

from jaxgrpo import plot


def _run(path, rewards, with_kl):
    path.mkdir()
    with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, r in enumerate(rewards, start=1):
            row = {"step": step, "reward/mean": r, "completion/length_mean": 10 + step}
            if with_kl:
                row["kl/mean"] = 0.01 * step
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": len(rewards), "eval/accuracy": 0.5}) + "\n")


def test_plot_cli_writes_pngs(tmp_path, capsys):
    _run(tmp_path / "a", [0.1, 0.2, 0.4], with_kl=True)
    _run(tmp_path / "b", [0.0, 0.1, 0.1], with_kl=False)
    out = tmp_path / "plots"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["accuracy.png", "kl.png", "length.png", "reward.png"], "no entropy logged"
    import matplotlib.image

    image = matplotlib.image.imread(out / "reward.png")
    assert image.shape[:2] == (400, 600) and np.ptp(image) > 0, "a non-blank 6x4 in figure"
    assert str(out / "reward.png") in capsys.readouterr().out


def test_read_metrics_merges_steps_and_names_missing_dir(tmp_path):
    _run(tmp_path / "a", [0.1, 0.3], with_kl=False)
    rows = plot.read_metrics(str(tmp_path / "a"))
    assert rows[2]["reward/mean"] == 0.3 and rows[2]["eval/accuracy"] == 0.5
    key, steps, values = plot.series(rows, ("missing", "reward/mean"))
    assert key == "reward/mean" and steps.tolist() == [1, 2] and values.tolist() == [0.1, 0.3]
    with pytest.raises(FileNotFoundError, match="run directory"):
        plot.read_metrics(str(tmp_path / "nope"))
