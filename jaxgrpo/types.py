"""Array aliases and the axis-letter legend used in names and einsum strings.

Axis letters, used as shape suffixes (``logits_BTV``) and in einsums (``'BTD,DNH->BTNH'``):

    B batch            P prompt length       T completion / query length
    S key / cache len  D embed (hidden)      N query heads
    K kv heads         H head_dim            F mlp (intermediate)
    V vocab            L layers              R lora rank
    G group size (samples per prompt)
"""

from typing import Any

import jax

Array = jax.Array
PyTree = Any
