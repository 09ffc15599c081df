"""``python -m jaxgrpo.export``: the entry point of ``jaxgrpo.run.export``."""

import sys

from jaxgrpo.run.export import main

if __name__ == "__main__":
    sys.exit(main())
