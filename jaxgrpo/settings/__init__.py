"""The config schema: the frozen dataclasses a run's ``ConfigDict`` becomes (``schema``) and the
checks that name a bad key or value before anything compiles (``checks``). The shipped config
files are ``jaxgrpo.configs``."""
