"""``python -m jaxgrpo.study --config STUDY [--out DIR] [--only ARM,...] [--base CONFIG]``: a study.

A study is a base config and a list of arms, each a label and a set of config overrides (a
study file's ``get_study()`` returns a ``Study``; shipped ones are in ``jaxgrpo/studies``). The
command checks every arm's config before anything trains, then for each arm in order trains it
in ``OUT/arms/<label>`` (an arm whose run reached its last step is skipped, an interrupted one
resumes from its checkpoint, as ``jaxgrpo.run.train`` does) and evaluates it on the held-out set
under the one protocol of the base config's ``eval`` section (``jaxgrpo.evaluate``'s sampling
and figures), as well as the untrained base model once. It then writes

- ``OUT/results.md``: the seed study's table, one row per arm (strict, lenient, format,
  pass@k, mean length of correct and incorrect answers, doom-loop rate, training wall time);
- ``OUT/results.json``: the same figures, each arm's overrides, run directory and eval file;
- ``OUT/plots/``: every arm overlaid: held-out accuracy over training, the dashboard, reward,
  KL, entropy and length (``jaxgrpo.run.plot``).

An arm may not set ``run_dir`` (the study owns it) or ``eval.*`` (one protocol for all arms).
An arm with ``steps`` 0 is the untrained model under its overrides (with tools, say).
An override's value may be a function of the base ``ConfigDict`` (e.g. a curriculum that ends
at half of ``steps``), so an arm keeps its meaning when ``--base`` points the study at another
config, such as ``gsm8k_hard`` on a TPU slice. On a multi-host slice every process runs this
command; process 0 writes the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxgrpo.core.errors import ConfigError, UserError, one_line_errors
from jaxgrpo.run.study_results import (
    Evaluator,
    read_json,
    results_markdown,
    trained_step,
    training_signal,
    write_json,
    write_plots,
)
from jaxgrpo.settings.loading import load_config, load_config_dict, parse_known_overrides
from jaxgrpo.settings.schema import TrainConfig

# jaxgrpo/studies: the shipped study files (they import this module, so it cannot import them).
STUDIES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
ARM_STATE = "study_arm.json"  # per arm: training wall time, summed over resumptions


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm of a study.

    Attributes:
      label: the arm's name: its row in the table and its directory (letters, digits, ``_.+-``).
      overrides: dotted config keys (``"rl.loss_type"``) to values, or to functions of the base
        ``ConfigDict`` returning the value.
      note: one line on what the arm tests (printed in ``results.md``).
    """

    label: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Study:
    """A base config and its arms.

    Attributes:
      name: the study's name (the default output directory is ``runs/studies/<name>``).
      base: config file or shipped config name every arm starts from.
      arms: the arms, trained in this order.
      overrides: applied to every arm before its own (same forms as ``Arm.overrides``).
      evaluate_base: also evaluate the untrained model (the table's first row).
      title: the heading of ``results.md``.
    """

    name: str
    base: str
    arms: Sequence[Arm]
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    evaluate_base: bool = True
    title: str = ""


# ----------------------------------------------------------------------------------------------
# Loading and checking.


def resolve_study_path(name: str) -> str:
    """A study file path, or a bare name of a shipped study (``reward_structure_mini``)."""
    if os.path.isfile(name):
        return name
    if os.sep not in name and "/" not in name:
        candidate = os.path.join(STUDIES_DIR, name if name.endswith(".py") else name + ".py")
        if os.path.isfile(candidate):
            return candidate
    shipped = sorted(f[:-3] for f in os.listdir(STUDIES_DIR) if f.endswith(".py") and f[0] != "_")
    raise UserError(
        f"study file {name!r} not found (relative to {os.getcwd()!r} or in jaxgrpo/studies). "
        f"Shipped studies: {', '.join(shipped)}"
    )


def load_study(name: str) -> Study:
    """``get_study()`` of a study file or shipped study, checked for labels and forbidden keys."""
    path = resolve_study_path(name)
    spec = importlib.util.spec_from_file_location(f"jaxgrpo_study_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_study"):
        raise UserError(f"study file {path!r} defines no get_study()")
    study = module.get_study()
    if not isinstance(study, Study):
        raise UserError(f"{path}: get_study() returned {type(study).__name__}, not a Study")
    if not study.arms:
        raise UserError(f"{path}: study {study.name!r} has no arms")
    seen: set[str] = set()
    for arm in study.arms:
        if not _LABEL.fullmatch(arm.label):
            raise UserError(f"{path}: arm label {arm.label!r} must be letters, digits, _ . + -")
        if arm.label in seen:
            raise UserError(f"{path}: arm label {arm.label!r} appears twice")
        seen.add(arm.label)
        for key in list(study.overrides) + list(arm.overrides):
            if key == "run_dir" or key.startswith("eval."):  # the study owns these
                raise UserError(
                    f"arm {arm.label!r}: config key {key!r} may not be overridden in a study "
                    "(the study sets run_dir, and every arm is evaluated under the base config's "
                    "eval section)"
                )
    return study


def _values(overrides: Mapping[str, Any], base: Any) -> dict[str, Any]:
    return {k: v(base) if callable(v) else v for k, v in overrides.items()}


def arm_configs(
    study: Study, out: str, base: str | None = None, extra: Mapping[str, Any] | None = None
) -> dict[str, TrainConfig]:
    """Every arm's validated ``TrainConfig`` (run_dir ``OUT/arms/<label>``), before any training.

    Args:
      study: the study.
      out: the output directory.
      base: replaces ``study.base`` (e.g. ``gsm8k_hard`` on a TPU slice).
      extra: dotted overrides applied to every arm last (the command line's ``--config.*``).

    Raises:
      UserError: an arm's override names an unknown key or a bad value; the message names the
        arm and the key.
    """
    base_name = base or study.base
    try:
        base_dict = load_config_dict(base_name)
    except ConfigError as e:
        raise UserError(f"base config: {e}") from None
    configs = {}
    for arm in study.arms:
        overrides = {
            **_values(study.overrides, base_dict),
            **_values(arm.overrides, base_dict),
            **dict(extra or {}),
            "run_dir": os.path.join(out, "arms", arm.label),
        }
        try:
            configs[arm.label] = load_config(base_name, overrides)
        except (ConfigError, ValueError, TypeError) as e:
            raise UserError(f"arm {arm.label!r}: {e}") from None
    return configs


def select(study: Study, only: str | None) -> list[Arm]:
    """The arms ``--only`` names (comma-separated labels), in the study's order; all if None."""
    if not only:
        return list(study.arms)
    wanted = [x.strip() for x in only.split(",") if x.strip()]
    known = [a.label for a in study.arms]
    unknown = [x for x in wanted if x not in known]
    if unknown:
        raise UserError(f"--only names unknown arm(s) {unknown}; the study's arms: {known}")
    return [a for a in study.arms if a.label in wanted]


# ----------------------------------------------------------------------------------------------
# Training.


def train_arm(cfg: TrainConfig) -> dict[str, Any]:
    """Trains one arm to ``cfg.steps`` (skipped when done, resumed when interrupted).

    Returns:
      ``{"step", "train_seconds", "skipped"}``; ``train_seconds`` sums the wall time of
      every resumption.

    Raises:
      UserError: the run stopped before its last step (SIGTERM, Ctrl-C); rerunning resumes it.
    """
    import jax

    from jaxgrpo.run import train

    state_path = os.path.join(cfg.run_dir, ARM_STATE)
    state = read_json(state_path)
    step = trained_step(cfg)
    if step >= cfg.steps:
        return {"step": step, "train_seconds": state.get("train_seconds", 0.0), "skipped": True}
    t0 = time.perf_counter()
    train.run(cfg)
    seconds = state.get("train_seconds", 0.0) + time.perf_counter() - t0
    if jax.process_index() == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        write_json(state_path, {"train_seconds": seconds})
    step = trained_step(cfg)
    if step < cfg.steps:
        raise UserError(
            f"the study stopped in {cfg.run_dir} at step {step} of {cfg.steps}; "
            "rerun the same command to resume"
        )
    return {"step": step, "train_seconds": seconds, "skipped": False}


# ----------------------------------------------------------------------------------------------
# The study.


def run_study(
    study: Study,
    out: str,
    only: str | None = None,
    base: str | None = None,
    extra: Mapping[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains and evaluates the selected arms, then writes results.md, results.json and plots.

    Returns:
      The ``results.json`` content.
    """
    import jax

    from jaxgrpo.run.build import start_distributed

    configs = arm_configs(study, out, base, extra)  # every arm checked before any training
    arms = select(study, only)
    first = configs[arms[0].label]
    start_distributed(first)
    say(f"study {study.name}: {len(arms)} arm(s) in {out}")
    evaluator = Evaluator(first)
    rows: dict[str, dict] = {}
    if study.evaluate_base:
        say("base model: evaluating ...")
        rows["base"] = evaluator("base", first, None, os.path.join(out, "base"))
        rows["base"]["train_seconds"] = None
    for i, arm in enumerate(arms, 1):
        cfg = configs[arm.label]
        say(f"arm {i}/{len(arms)} {arm.label}: training {cfg.steps} steps in {cfg.run_dir} ...")
        trained = train_arm(cfg)
        if not cfg.steps:
            say(f"arm {arm.label}: steps 0, evaluated untrained")
        elif trained["skipped"]:
            say(f"arm {arm.label}: already trained ({trained['step']} steps), skipped")
        say(f"arm {arm.label}: evaluating ...")
        trained_dir = cfg.run_dir if cfg.steps else None  # steps 0: the untrained model
        result = evaluator(arm.label, cfg, trained_dir, cfg.run_dir)
        rows[arm.label] = {**result, **trained, "run_dir": cfg.run_dir}
        rows[arm.label]["signal"] = training_signal(trained_dir)
        s = result["summary"]
        say(f"arm {arm.label}: strict {100 * s['strict_accuracy']:.1f}% [{result['file']}]")
    protocol = dataclasses.asdict(evaluator.settings)
    base_dict = load_config_dict(base or study.base)
    for arm in arms:
        rows[arm.label]["overrides"] = _values({**study.overrides, **arm.overrides}, base_dict)
    results = {
        "study": study.name,
        "base_config": base or study.base,
        "protocol": protocol,
        "arms": rows,
    }
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, "results.json"), results)
        table = results_markdown(study, rows, protocol)
        with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
            f.write(table)
        trained = {a.label: configs[a.label].run_dir for a in arms if configs[a.label].steps}
        plots = write_plots(trained, os.path.join(out, "plots"))
        say(table)
        say(
            f"wrote {os.path.join(out, 'results.md')}, results.json and {len(plots)} plots in "
            f"{os.path.join(out, 'plots')}"
        )
    return results


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments; ``args.overrides`` holds the ``--config.KEY=VALUE`` pairs."""
    p = argparse.ArgumentParser(prog="python -m jaxgrpo.study", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="study file or shipped study name")
    p.add_argument("--out", help="output directory (default runs/studies/<name>)")
    p.add_argument("--only", help="comma-separated arm labels to run (default: all)")
    p.add_argument("--base", help="config replacing the study's base config (e.g. gsm8k_hard)")
    args, overrides = parse_known_overrides(p, argv)
    args.overrides = dict(overrides)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry."""
    from jaxgrpo.core.host import prepare_cli

    prepare_cli()
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    with one_line_errors():
        study = load_study(args.config)
        out = args.out or os.path.join("runs", "studies", study.name)
        run_study(study, out, args.only, args.base, args.overrides)
    return 0


if __name__ == "__main__":
    # Run the imported module's main: study files build `jaxgrpo.run.study.Study`s, which a main in
    # this `__main__` copy of the module would not recognise as its own class.
    from jaxgrpo.run import study

    sys.exit(study.main())
