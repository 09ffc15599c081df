"""``python -m jaxgrpo.study``: the entry point of ``jaxgrpo.run.study``."""

import sys

from jaxgrpo.run.study import main

if __name__ == "__main__":
    sys.exit(main())
