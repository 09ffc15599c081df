"""Errors the code understood, reported as one line by the CLIs (`one_line_errors`), and
optional packages that name the extra installing them (`require`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import traceback
from typing import Any


class UserError(Exception):
    """An error the code understood, whose message names what is wrong (a config key, a file, a
    data row, a reward function, a missing package): the CLIs print it as one line."""


ERROR_LOG = os.path.join(tempfile.gettempdir(), "jaxgrpo-last-error.log")


@contextlib.contextmanager
def one_line_errors():
    """Turns a ``UserError`` or ``OSError`` raised inside into ``error: <message>`` and exit
    status 1; the traceback goes to ``ERROR_LOG`` (the line names it) for whoever needs it."""
    try:
        yield
    except (UserError, OSError) as e:
        with open(ERROR_LOG, "w", encoding="utf-8") as f:
            traceback.print_exc(file=f)
        sys.exit(f"error: {e} (traceback: {ERROR_LOG})")


class ConfigError(UserError, ValueError):
    """A config problem, with the offending key in the message."""


def config_require(ok: bool, key: str, message: str, value: Any) -> None:
    """Raises ``ConfigError`` naming ``key`` and its ``value`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"config key {key!r} = {value!r}: {message}")


class MissingExtra(UserError, ImportError):
    """An optional package is missing; the message names the ``pip install`` that brings it."""

    def __init__(self, package: str, extra: str, needed_for: str):
        super().__init__(
            f'{needed_for} needs the {package!r} package: pip install "jaxgrpo[{extra}]"'
        )


def require(module: str, extra: str, needed_for: str) -> Any:
    """Imports optional ``module`` or raises ``MissingExtra`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(module, extra, needed_for) from None
