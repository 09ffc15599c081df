"""``python -m jaxgrpo.train``: the entry point of ``jaxgrpo.run.train``."""

import sys

from jaxgrpo.run.train import main

if __name__ == "__main__":
    sys.exit(main())
