"""``python -m jaxgrpo.compile``: the entry point of ``jaxgrpo.planning.compile``."""

import sys

from jaxgrpo.planning.compile import main

if __name__ == "__main__":
    sys.exit(main())
