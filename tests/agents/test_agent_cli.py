"""TRL's tool function and environment class, written as a TRL user writes them (a module of
the user's, named by dotted path), run unchanged through ``python -m jaxgrpo.train``: the run
trains on episodes, a TRL reward reads the conversational completions and the environments,
the environment's ``get_reward()`` is a reward term under its class's name, and the metrics and
samples show the episodes."""

import json
import subprocess
import sys
import textwrap

import pytest

USER_MODULE = '''
def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


class CounterEnv:
    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        return None

    def increment(self, step: int) -> int:
        """
        Increment the counter by a given step.

        Args:
            step: The value to add to the counter.

        Returns:
            The new value of the counter.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)


def reward_func(environments, completions, **kwargs):
    return [len(c[-1]["content"]) % 3 + env.counter for c, env in zip(completions, environments)]
'''


@pytest.mark.slow  # one tiny run with tools: about 45 s
def test_trl_tools_and_environment_run_unchanged_through_the_cli(tmp_path, cli_env):
    (tmp_path / "trl_tools.py").write_text(textwrap.dedent(USER_MODULE))
    run = tmp_path / "run"
    args = [
        "--config=tiny",
        f"--config.run_dir={run}",
        "--config.steps=2",
        "--config.agent.tools=('trl_tools.multiply',)",
        "--config.agent.environment=trl_tools.CounterEnv",
        "--config.agent.format=json",
        "--config.rewards.conversational=True",
        "--config.rewards.functions=(('trl_tools.reward_func', 1.0),)",
    ]
    env = {**cli_env, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "jaxgrpo.train", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 2 steps" in out.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["reward/trl_tools.reward_func/failed_frac"] == 0.0, "the TRL reward ran"
    assert step["reward/CounterEnv/weight"] == 1.0 and "reward/CounterEnv/mean" in step
    for key in ("agent/tool_calls", "agent/turns", "agent/model_tokens", "agent/failed"):
        assert key in step, key
    assert "eval/agent/turns" in rows[0] or any("eval/agent/turns" in r for r in rows)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all("turns" in s and s["turns"] for s in samples)


def test_a_tool_that_cannot_be_described_fails_in_one_line(tmp_path, cli_env):
    (tmp_path / "bad_tools.py").write_text("def untyped(x):\n    return x\n")
    args = ["--config=tiny", f"--config.run_dir={tmp_path / 'run'}"]
    args.append("--config.agent.tools=('bad_tools.untyped',)")
    env = {**cli_env, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "jaxgrpo.train", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode != 0
    assert "untyped" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
