"""Evaluation: accuracy definitions, batched completions, figures, the judge and the CLI.

* ``accuracy``: strict / lenient / format, the one definition (training metrics use it too).
* ``completions``: ``Settings`` and the one batched generation loop over the mesh.
* ``held_out``: greedy held-out evaluation during training (``Learner.evaluate``).
* ``metrics``: pass@k, lengths, doom loops and tables, pure functions of strings and numbers.
* ``judge``: a yes/no judge model asked with the config's ``eval.judge_prompt``.
* ``cli``: ``python -m jaxgrpo.evaluate``.

Nothing is imported here, so ``jaxgrpo.rl`` can import ``accuracy`` and ``held_out`` without
loading the CLI.
"""
