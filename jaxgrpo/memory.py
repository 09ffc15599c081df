"""``python -m jaxgrpo.memory``: the entry point of ``jaxgrpo.planning.memory``."""

import sys

from jaxgrpo.planning.memory import main

if __name__ == "__main__":
    sys.exit(main())
