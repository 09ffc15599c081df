"""Array aliases and the axis-letter legend used in names and einsum strings.

Axis letters, used as shape suffixes (``logits_BTV``) and in einsums (``'BTD,DNH->BTNH'``):

    B batch (prompts)  P prompt length       T completion / query length
    S key / cache len  D embed (hidden)      N query heads (only)
    K kv heads         H head_dim            F mlp (intermediate)
    V vocab            L layers              G group size (samples per prompt)
    R rows of samples (R = B * G)            A LoRA (adapter) rank
    Y labels of a classifier's score head (one for a reward model)

A function may name a further letter for a local axis (a chunk C, a group X of fused rows);
its docstring says what it is.
"""

from typing import Any

import jax

Array = jax.Array
PyTree = Any
