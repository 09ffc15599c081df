"""The config schema: the frozen dataclasses a run's ``ConfigDict`` becomes (``schema``), the
checks that name a bad key or value before anything compiles (``checks``) and the reading of
config files and dotted overrides (``loading``). The shipped config files are
``jaxgrpo.configs``."""
