"""``python -m jaxgrpo.evaluate``: the entry point of ``jaxgrpo.run.evaluate``."""

import sys

from jaxgrpo.run.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
