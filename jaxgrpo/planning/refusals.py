"""What ``python -m jaxgrpo.compile`` refuses before anything compiles, each in one line that
names the config key and the knobs: a second model (teacher, reward model) whose weights do
not fit beside the policy's persistent state, and a sampler on devices of its own
(``mesh.sampler_devices``) that cannot hold its copy of the weights. Both read the analytic
estimate (``jaxgrpo.planning.memory``) against ``USABLE`` of a chip's HBM.
"""

from __future__ import annotations

from typing import Any

from jaxgrpo.core.presets import GIB
from jaxgrpo.planning import memory
from jaxgrpo.settings.checks import sampler_mesh_shape

USABLE = 0.9  # of a chip's HBM: what the runtime and the compiler's own buffers leave


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def check_second_models(cfg: Any, mesh: dict[str, int], preset, prompt_len: int) -> None:
    """Refuses a second model whose weights do not fit beside the policy's persistent state
    (with a lagging sampler on shared devices, its versions too) on the slice's chips.

    Args:
      cfg: the run's ``TrainConfig``.
      mesh: the learner's mesh sizes.
      preset: the slice.
      prompt_len: the prompt bucket (tokens).
    """
    model_cfg, run = memory.from_train_config(cfg, prompt_len)
    others = memory.second_models(cfg)
    est = memory.estimate(model_cfg, run, mesh, preset.hbm_bytes, others)
    persistent = ("params", "grads", "opt_state", "ref_params", "stale_params", *others)
    static = sum(est[k] for k in persistent)
    usable = USABLE * preset.hbm_bytes
    if not others or static <= usable:
        return
    name = max(others, key=lambda n: est[n])  # the largest second model is named
    key = memory.second_model_sources(cfg)[name][0]
    bf16 = ", set model.param_dtype='bfloat16'" * (cfg.model.param_dtype == "float32")
    raise ValueError(
        f"{key}: the {name}'s weights ({_gib(est[name])} GiB per chip) and the policy's "
        f"state ({_gib(static - est[name])} GiB) exceed {_gib(usable)} GiB per chip on "
        f"{preset.name} (mesh {mesh}): raise mesh.fsdp or mesh.tensor{bf16}, or use a "
        "larger slice"
    )


def check_sampler_side(cfg: Any, mesh: dict[str, int], preset, prompt_len: int) -> None:
    """Refuses a sampler on devices of its own that cannot hold what it keeps per chip: the
    frozen weights, k = ``rl.max_staleness`` versions of the trainable params and the
    decode's KV cache (``memory.sampler_side``). The decode's resharded weights are left
    out, so a refused split cannot fit whatever the compiler does. Nothing to check when the
    sampler shares the learner's devices.

    Args:
      cfg: the run's ``TrainConfig``.
      mesh: the learner's mesh sizes (the sampler's follow, ``checks.sampler_mesh_shape``).
      preset: the slice.
      prompt_len: the prompt bucket (tokens).
    """
    n = cfg.mesh.sampler_devices
    if not n:
        return
    sampler = sampler_mesh_shape(cfg, mesh)
    model_cfg, run = memory.from_train_config(cfg, prompt_len)
    est = memory.sampler_side(model_cfg, run, sampler, preset.hbm_bytes)
    weights = est["frozen"] + est["trainable_copies"]
    need, usable = weights + est["kv_cache"], USABLE * preset.hbm_bytes
    if need <= usable:
        return
    if weights > est["kv_cache"]:  # weights split over the sampler's fsdp x tensor only
        knob = (
            f"raise mesh.tensor, or pick mesh.sampler_devices so that N / tensor shares more "
            f"of the learner's fsdp = {mesh['fsdp']} (the sampler's weights split over its "
            f"fsdp = {sampler['fsdp']} x tensor = {sampler['tensor']})"
        )
    else:
        knob = "raise mesh.sampler_devices (the cache splits over the sampler's data x fsdp)"
    raise ValueError(
        f"mesh.sampler_devices: the sampler's {n} chips (mesh {sampler}) must hold "
        f"{_gib(need)} GiB per chip (frozen weights {_gib(est['frozen'])}, "
        f"{run.max_staleness} trainable version(s) {_gib(est['trainable_copies'])}, decode KV "
        f"cache {_gib(est['kv_cache'])}), over {_gib(usable)} GiB usable on {preset.name}: "
        f"{knob}, or lower rl.max_staleness"
    )
