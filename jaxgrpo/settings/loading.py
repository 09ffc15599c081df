"""Loading run configurations: config files by path or shipped name, and dotted overrides.

``load_config`` (the Python API) and the CLIs' ``--config FILE --config.a.b=v`` go through
here: the file's ``get_config()`` is locked, overrides are set key by key (errors name the key),
and ``schema.to_train_config`` validates and freezes the result. ``run_config`` also reads a
run directory's ``config.json`` snapshot back, and ``is_run_dir`` tells such a directory from a
model checkpoint's, whose ``config.json`` is a Hugging Face one.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath
from ml_collections import ConfigDict

from jaxgrpo.configs import base
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.settings.checks import unknown_key_error
from jaxgrpo.settings.schema import TrainConfig, to_train_config

SHIPPED_DIR = os.path.dirname(os.path.abspath(base.__file__))  # jaxgrpo/configs


def shipped_configs() -> list[str]:
    """Names of the configs shipped in ``jaxgrpo/configs`` (without ``.py``)."""
    names = [f[:-3] for f in os.listdir(SHIPPED_DIR) if f.endswith(".py") and f[0] != "_"]
    return sorted(names)


def resolve_config_path(name: str) -> str:
    """Maps a ``--config`` value to a file path.

    A path that exists (relative to the working directory or absolute) is used as is. Otherwise a
    bare name (``gsm8k_hard`` or ``gsm8k_hard.py``, no directory part) resolves to the shipped
    ``jaxgrpo/configs``. A ``:arg`` suffix (ml_collections' parameterised configs) is kept.

    Raises:
      ConfigError: the file exists nowhere; the message lists the shipped configs.
    """
    path, sep, arg = name.partition(":")
    if os.path.isfile(path):
        return name
    if os.sep not in path and "/" not in path:
        candidate = os.path.join(SHIPPED_DIR, path if path.endswith(".py") else path + ".py")
        if os.path.isfile(candidate):
            return candidate + sep + arg
    raise ConfigError(
        f"config file {path!r} not found (relative to {os.getcwd()!r} or in jaxgrpo/configs). "
        f"Shipped configs: {', '.join(shipped_configs())}"
    )


def load_config_dict(name: str) -> ConfigDict:
    """Loads ``get_config()`` from a config file path or shipped name (unlocked, unvalidated)."""
    path, _, arg = resolve_config_path(name).partition(":")
    spec = importlib.util.spec_from_file_location(f"jaxgrpo_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


TASK_KWARGS = "task.kwargs."


def set_task_kwargs(cfg: ConfigDict, kwargs: Mapping[str, Any]) -> None:
    """Sets the task's own keyword arguments (``task.kwargs.<name>``) on a locked ConfigDict.

    ``task.kwargs`` is free-form (its keys are the task's dataclass fields, which ``validate``
    checks), so these keys may be new; string values are read as Python literals when they
    parse as one (``3``, ``True``, ``(1, 2)``) and kept as strings otherwise.
    """
    with cfg.unlocked():
        for name, value in kwargs.items():
            cfg.task.kwargs[name] = _literal(value) if isinstance(value, str) else value


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(cfg: ConfigDict, overrides: Mapping[str, Any]) -> None:
    """Sets dotted keys (``{"rl.beta": 0.0}``) on a locked ConfigDict; errors name the key.

    ``task.kwargs.<name>`` keys go to ``set_task_kwargs`` (they may be new).
    """
    task_kwargs = {
        k[len(TASK_KWARGS) :]: v for k, v in overrides.items() if k.startswith(TASK_KWARGS)
    }
    set_task_kwargs(cfg, task_kwargs)
    for key, value in overrides.items():
        if key.startswith(TASK_KWARGS):
            continue
        node, _, leaf = key.rpartition(".")
        parent = cfg
        for part in filter(None, node.split(".")):
            if part not in parent or not isinstance(parent[part], ConfigDict):
                raise unknown_key_error(key, parent, part)
            parent = parent[part]
        if leaf not in parent:
            raise unknown_key_error(key, parent, leaf)
        try:
            parent[leaf] = value
        except TypeError as e:
            raise ConfigError(f"config key {key!r}: {e}") from None


def load_config(name: str, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Python API twin of the CLI: file (or shipped name) + dotted overrides -> ``TrainConfig``.

    Args:
      name: a config path or shipped name, as for ``--config``.
      overrides: ``{"rl.beta": 0.0, ...}``, as ``--config.rl.beta=0.0`` would set.
    """
    cfg = load_config_dict(name)
    cfg.lock()
    apply_overrides(cfg, overrides or {})
    return to_train_config(cfg)


def config_override(text: str) -> tuple[str, Any]:
    """``--config.a.b=v`` -> ("a.b", v) with v a Python literal when it parses as one."""
    key, _, value = text.removeprefix("--config.").partition("=")
    return key, _literal(value)


def parse_known_overrides(parser: Any, argv: Sequence[str]) -> tuple[Any, list[tuple[str, Any]]]:
    """``parser``'s arguments and the ``--config.KEY=VALUE`` pairs after them, in order; any
    other unknown argument is a usage error (``parser.error``)."""
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, [config_override(a) for a in rest]


def run_config(
    config: str | None, run_dir: str | None, overrides: Mapping[str, Any]
) -> TrainConfig:
    """The ``TrainConfig`` of a run: ``config`` (file or shipped name) if given, else the run
    directory's ``config.json`` (a local path or ``gs://``); then ``overrides`` (dotted keys)."""
    if config:
        return load_config(config, overrides)
    path = epath.Path(run_dir or ".") / "config.json"
    if not path.exists():
        raise ConfigError(f"no --config given and no {path}; pass --config")
    cfg = base.get_config()
    _assign(cfg, json.loads(path.read_text()))
    cfg.lock()
    apply_overrides(cfg, overrides)
    return to_train_config(cfg)


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a local path or ``gs://``) is a run directory: its ``config.json`` is
    a run's snapshot (``model`` and ``rl`` sections), not a Hugging Face model's config."""
    config = epath.Path(path) / "config.json"
    if not config.exists():
        return False
    try:
        snapshot = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(snapshot, dict) and {"model", "rl"} <= snapshot.keys()


def _assign(node: ConfigDict, values: Mapping[str, Any]) -> None:
    """Copies a ``TrainConfig.to_dict()`` JSON into a ConfigDict (lists back to tuples)."""

    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    for key, value in values.items():
        if key in node and isinstance(node[key], ConfigDict) and isinstance(value, dict):
            _assign(node[key], value)
        else:
            node[key] = tuples(value)
