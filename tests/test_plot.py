"""``python -m jaxgrpo.plot``: a dashboard of every panel plus one PNG per logged quantity, runs
overlaid in one colour each, missing quantities skipped (PNGs) or marked "no data" (dashboard)."""

import json

import numpy as np
import pytest

from jaxgrpo.run import plot


def _run(path, rewards, with_kl):
    path.mkdir()
    with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, r in enumerate(rewards, start=1):
            row = {"step": step, "reward/mean": r, "completion/length_mean": 10 + step}
            if with_kl:
                row["kl/mean"] = 0.01 * step
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": len(rewards), "eval/strict_accuracy": 0.5}) + "\n")


def _learning_run(path, steps, rate, functions=("format", "exact_answer")):
    """metrics.jsonl of a run whose accuracy rises at ``rate``: the learner's keys, held-out
    figures at steps 0, 5, 10, ... and the end, no correct answer (null length) at step 1."""
    path.mkdir()
    rows = []
    for step in range(steps + 1):
        acc = 1 - np.exp(-rate * step)
        row = {"step": step}
        if step:
            row |= {f"reward/{fn}/mean": acc * (i + 1) / 2 for i, fn in enumerate(functions)}
            row |= {f"reward/{fn}/std": 0.1 for fn in functions}
            row |= {"strict_accuracy": acc, "lenient_accuracy": acc, "format_rate": 0.5}
            row |= {"kl/mean": 0.002 * step, "entropy": 1.2 - 0.03 * step}
            row |= {"completion/length_correct": None if step == 1 else 20 + step}
            row |= {"completion/length_incorrect": 60 - step, "completion/truncated_frac": 0.1}
            row |= {"temperature": 1.0 - 0.02 * step}
        if step % 5 == 0 or step == steps:
            row |= {"eval/strict_accuracy": acc * 0.9, "eval/lenient_accuracy": acc}
            row |= {"eval/format_rate": 0.8}
        rows.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return str(path)


def test_plot_cli_writes_pngs(tmp_path, capsys):
    _run(tmp_path / "a", [0.1, 0.2, 0.4], with_kl=True)
    _run(tmp_path / "b", [0.0, 0.1, 0.1], with_kl=False)
    out = tmp_path / "plots"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["accuracy.png", "dashboard.png", "kl.png", "length.png", "reward.png"], (
        "no entropy logged: no entropy.png"
    )
    import matplotlib.image

    image = matplotlib.image.imread(out / "reward.png")
    assert image.shape[:2] == (400, 600) and np.ptp(image) > 0, "a non-blank 6x4 in figure"
    dashboard = matplotlib.image.imread(out / "dashboard.png")
    assert dashboard.shape[:2] == (1080, 1500), "3 x 3 panels of 5 x 3.4 in, 100 dpi"
    assert str(out / "dashboard.png") in capsys.readouterr().out


def test_dashboard_panels_runs_and_no_data(tmp_path):
    a = _learning_run(tmp_path / "fast", 12, rate=0.3)
    b = _learning_run(tmp_path / "slow", 8, rate=0.1, functions=("format",))
    fig = plot.dashboard_figure(plot.read_runs([a, b]))
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert list(axes) == list(plot.DASHBOARD), "every panel, in the dashboard's order"
    empty = [t for t, ax in axes.items() if any(x.get_text() == "no data" for x in ax.texts)]
    assert empty == ["clip fraction"], "the one quantity neither run logged says so"

    def lines(title):
        return [line for line in axes[title].get_lines() if len(line.get_xdata())]

    train_acc = lines("train accuracy")
    fast, slow = train_acc[0].get_color(), train_acc[-1].get_color()
    assert fast != slow and [line.get_color() for line in train_acc] == [fast] * 3 + [slow] * 3
    styles = [line.get_linestyle() for line in train_acc[:3]]
    assert styles == ["-", ":", "--"], "strict, lenient, format"
    rewards = lines("reward per function")
    assert [line.get_color() for line in rewards] == [fast, fast, slow], "per function, per run"
    assert [line.get_linestyle() for line in rewards] == ["-", "--", "-"], "style per function"
    held_out = lines("held-out accuracy")
    assert [line.get_xdata().tolist() for line in held_out[:3]] == [[0, 5, 10, 12]] * 3
    assert held_out[0].get_marker() == "o" and held_out[0].get_color() == fast
    correct, incorrect = lines("completion length")[:2]
    assert correct.get_xdata().tolist() == list(range(2, 13)), "a step without correct answers"
    assert incorrect.get_linestyle() == "--"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["fast", "slow"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_read_metrics_merges_steps_and_names_missing_dir(tmp_path, capsys):
    _run(tmp_path / "a", [0.1, 0.3], with_kl=False)
    rows = plot.read_metrics(str(tmp_path / "a"))
    assert rows[2]["reward/mean"] == 0.3 and rows[2]["eval/strict_accuracy"] == 0.5
    key, steps, values = plot.series(rows, ("missing", "reward/mean"))
    assert key == "reward/mean" and steps.tolist() == [1, 2] and values.tolist() == [0.1, 0.3]
    with pytest.raises(FileNotFoundError, match="run directory"):
        plot.read_metrics(str(tmp_path / "nope"))
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: "), "one line, no traceback"
    assert list(plot.read_runs([str(tmp_path / "a")] * 2)) == ["a", "a-2"], "labels are unique"


def test_a_run_with_tools_gets_a_tool_use_panel(tmp_path):
    run = tmp_path / "agent"
    run.mkdir()
    rows = [
        {"step": s, "reward/mean": 0.1 * s, "agent/tool_calls": 0.5 + 0.1 * s, "agent/turns": 1.4}
        | {"agent/failed": 0.05}
        for s in range(1, 6)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = plot.read_runs([str(run)])
    assert list(plot.dashboard_panels(runs))[-1] == "tool use"
    fig = plot.dashboard_figure(runs)
    ax = next(ax for ax in fig.axes if ax.get_title() == "tool use")
    lines = [line for line in ax.get_lines() if len(line.get_xdata())]
    assert len(lines) == 3 and lines[0].get_ydata()[-1] == pytest.approx(1.0)
    assert "tool use" not in plot.dashboard_panels(
        plot.read_runs([_learning_run(tmp_path / "plain", 3, rate=0.2)])
    )
    import matplotlib.pyplot as plt

    plt.close(fig)
