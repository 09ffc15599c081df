"""Shipped experiment configs: one ml_collections file per experiment, each built on ``base.py``.

``python -m jaxgrpo.train --config NAME`` resolves a bare ``NAME`` (or ``NAME.py``) here when no
such path exists relative to the working directory.
"""
