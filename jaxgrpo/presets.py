"""``python -m jaxgrpo.presets``: the entry point of ``jaxgrpo.core.presets``."""

import sys

from jaxgrpo.core.presets import main

if __name__ == "__main__":
    sys.exit(main())
