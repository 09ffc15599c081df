"""The run's model as its config's ``model`` section describes it, built here once for training
(``jaxgrpo.run.build``), compilation (``jaxgrpo.planning.aot``) and the memory estimate
(``jaxgrpo.planning.memory``): adapters, dtypes, remat and the layout of the platform the run
is compiled for. A run directory as the source has its own source's architecture."""

from __future__ import annotations

from typing import Any

from jaxgrpo.core.errors import ConfigError
from jaxgrpo.models import source_config
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.layout import Layout
from jaxgrpo.settings.loading import is_run_dir, run_config
from jaxgrpo.settings.schema import ModelSpec


def model_fields(spec: ModelSpec, platform: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields ``spec`` sets for a run compiled for ``platform`` ("cpu",
    "tpu", "gpu"): also ``load_model``'s keyword arguments."""
    lora = None
    if spec.lora_rank > 0:
        lora = LoRAConfig(rank=spec.lora_rank, alpha=spec.lora_alpha, targets=spec.lora_targets)
    layout = Layout.for_platform(
        platform, layer_loop=spec.layer_loop, lora_rank=spec.lora_rank, remat=spec.remat
    )
    return dict(
        lora=lora,
        dtype=spec.dtype,
        param_dtype=spec.param_dtype,
        remat=spec.remat,
        remat_policy=spec.remat_policy,
        layout=layout,
    )


def model_config(spec: ModelSpec, platform: str, source: str | None = None) -> ModelConfig:
    """The run's ``ModelConfig`` without loading weights: the architecture of ``source``
    (default ``spec.source``) with ``model_fields(spec, platform)``."""
    source, seen = source or spec.source, set()
    while is_run_dir(source):  # a run's trained policy has the shape of the model it started from
        if source in seen:
            raise ConfigError(f"model source {source!r}: a run directory trained from itself")
        seen.add(source)
        source = run_config(None, source, {}).model.source
    return source_config(source, **model_fields(spec, platform))
