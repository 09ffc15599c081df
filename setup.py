"""jaxgrpo: group-relative RL fine-tuning of Llama/Qwen models in JAX/Flax."""

from setuptools import find_packages, setup

# Exact pins: jax and flax are upgraded on purpose, never by accident (STYLE.md section 2).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "ml-collections==1.1.0",
    "absl-py==2.5.1",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "jinja2==3.1.6",  # chat templates (transformers renders them with jinja2)
    "safetensors==0.8.0",
    "gguf==0.19.0",
    "numpy==2.4.6",
    "tensorboardX==2.6.5",
    "tqdm==4.70.1",
    "sacrebleu==2.6.0",
    "pronouncing==0.3.0",
    "matplotlib==3.11.2",
    "jaxtyping==0.3.11",
    "math-verify==0.9.0",  # MATH-style answer checks (math, jeebench), as TRL's accuracy_reward
]

EXTRAS = {
    "test": [
        "torch==2.13.0",
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
        "pytest-xdist==3.8.0",  # the suite runs in two workers (pyproject.toml's addopts)
        "chex==0.1.92",
        "hypothesis==6.170.17",
        "ruff==0.17.6",
        "peft==0.21.2",
        "nbclient==0.11.0",
        "nbformat==5.11.1",
        "ipykernel==7.4.0",
        "pyarrow==26.0.1",
    ],
    # Peers for benchmarks/ (not needed by the tests).
    "bench": [
        "torch==2.13.0",
        "trl==1.16.0",
        "peft==0.21.2",
        "accelerate==1.15.0",
        "datasets==5.2.0",
    ],
    "data": ["datasets==5.2.0", "pyarrow==26.0.1"],
    "tpu": ["jax[tpu]==0.10.2"],
    "gpu": ["jax[cuda12]==0.10.2"],
}

setup(
    name="jaxgrpo",
    version="0.1.0",
    description="GRPO-family RL fine-tuning of Llama/Qwen LLMs in JAX/Flax, laptop to TPU pod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["jaxgrpo", "jaxgrpo.*"]),
    # configs/ ships inside the package as jaxgrpo/configs so `--config gsm8k_hard.py` resolves
    # from any directory after `pip install`; the top-level configs/ is a symlink for readers.
    package_data={"jaxgrpo": ["configs/*.py", "data/fixtures/*"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
