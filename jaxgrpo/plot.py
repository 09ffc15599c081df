"""``python -m jaxgrpo.plot``: the entry point of ``jaxgrpo.run.plot``."""

import sys

from jaxgrpo.run.plot import main

if __name__ == "__main__":
    sys.exit(main())
