"""``python -m jaxgrpo.memory``: the entry point of ``jaxgrpo.planning.memory_report``."""

import sys

from jaxgrpo.planning.memory_report import main

if __name__ == "__main__":
    sys.exit(main())
