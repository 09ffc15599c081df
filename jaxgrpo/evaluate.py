"""``python -m jaxgrpo.evaluate``: the evaluation CLI, ``jaxgrpo.eval.cli``."""

import sys

from jaxgrpo.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
