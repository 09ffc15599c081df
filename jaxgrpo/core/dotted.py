"""Objects named by dotted path in a config: ``"my_pkg.module.name"`` or ``"my_pkg.module:name"``
(reward functions, tools, environment classes)."""

from __future__ import annotations

import importlib


def import_dotted(path: str) -> object:
    """The object ``path`` names.

    Raises:
      ImportError: the module cannot be imported, or has no such attribute (the message says
        which).
    """
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path ('package.module.name')")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None
