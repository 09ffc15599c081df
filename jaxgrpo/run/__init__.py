"""A run from a config: building its parts (``build``), the training driver (``train``),
evaluation, studies, export and plots; the ``python -m jaxgrpo.X`` entry points call these."""
