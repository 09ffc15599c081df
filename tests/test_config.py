"""Config schema, shipped configs, validation errors that name the key, frozen dataclasses."""

import dataclasses
import json
import re

import pytest
from ml_collections import ConfigDict

from jaxgrpo.configs import base
from jaxgrpo.configs.base import JUDGE_PROMPT
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.rl.loss_spec import LOSS_PRESETS
from jaxgrpo.run.build import build_model
from jaxgrpo.settings.checks import sampler_mesh_shape
from jaxgrpo.settings.loading import load_config, shipped_configs
from jaxgrpo.settings.model import model_config, model_fields
from jaxgrpo.settings.schema import TrainConfig, resolve_mesh_shape, to_train_config


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, TrainConfig)
    assert json.loads(json.dumps(cfg.to_dict()))["run_dir"] == cfg.run_dir


def test_expected_configs_ship_and_every_base_field_has_a_comment():
    expected = {"base", "format_copy", "tiny", "gsm8k_hard", "gsm8k_perplexity", "gsm8k_embedding"}
    expected |= {"gsm8k_embedding_bleu", "gsm8k_hard_soft", "gsm8k_curriculum", "gsm8k_anneal"}
    expected |= {"sonnets", "gsm8k_tool"}
    assert expected <= set(shipped_configs())
    with open(base.__file__, encoding="utf-8") as f:
        lines = f.read().splitlines()
    fields = [i for i, line in enumerate(lines) if re.match(r"\s+c\.[a-z_.]+ = ", line)]
    assert len(fields) >= 60
    for i in fields:
        commented = "  # " in lines[i] or lines[i - 1].strip().startswith("#")
        assert commented, f"base.py line {i + 1} has no comment: {lines[i].strip()}"


BAD_OVERRIDES = [
    ({"rl.eps_low": -0.1}, "rl.eps_low"),
    ({"rl.group_size": 1}, "rl.group_size"),
    ({"rl.num_minibatches": 3}, "rl.num_minibatches"),
    ({"rl.grad_accum": 2, "mesh.data": 8}, "rl.prompts_per_step"),  # 4 sequences, 8 shards
    ({"rl.grad_accum": 4}, "rl.grad_accum"),  # 4 micro-batches of 2 prompts: not whole groups
    ({"rl.grad_accum": 16}, "rl.grad_accum"),  # 16 micro-batches of an 8-sequence batch
    ({"rl.kl_in_reward": True, "rl.beta": 0.0}, "rl.kl_in_reward"),
    ({"rl.ref_reset_optimizer": True}, "rl.ref_reset_optimizer"),
    ({"rl.loss_type": "ppo"}, "rl.loss_type"),
    ({"sampling.top_p": 0.0}, "sampling.top_p"),
    ({"sampling.stop": ("</calc>", "")}, "sampling.stop"),  # an empty stop string
    ({"sampling.stop": ("</calc>", "</calc>")}, "sampling.stop"),  # a repeated one
    ({"sampling.temperature": 0.0}, "sampling.temperature"),
    (
        {"sampling.temperature_schedule.kind": "linear", "sampling.temperature_schedule.end": 0.0},
        "sampling.temperature_schedule.end",
    ),
    ({"rl.tis_cap": 0.5}, "rl.tis_cap"),
    ({"sampling.temperature_schedule.kind": "zigzag"}, "sampling.temperature_schedule.kind"),
    ({"sampling.repetition_guard": (3, 1)}, "sampling.repetition_guard"),
    ({"model.lora_targets": ("q", "qkv")}, "model.lora_targets"),
    ({"model.dtype": "float16"}, "model.dtype"),
    ({"model.layer_loop": "while"}, "model.layer_loop"),
    ({"model.remat_policy": "dots"}, "model.remat_policy"),
    ({"optim.schedule": "linear"}, "optim.schedule"),
    ({"optim.lr": 0.0}, "optim.lr"),
    ({"mesh.data": -1, "mesh.fsdp": -1}, "mesh.fsdp"),
    ({"mesh.data": 3}, "rl.prompts_per_step"),
    ({"rewards.functions": (("no_such_reward", 1.0),)}, "rewards.functions[0]"),
    ({"rewards.functions": (("bleu", {"kind": "linear", "end_step": 0}),)}, "rewards.functions"),
    ({"rewards.reward_on_error": "ignore"}, "rewards.reward_on_error"),
    ({"checkpoint.keep": 0}, "checkpoint.keep"),
    ({"eval.num_samples": 0}, "eval.num_samples"),
    ({"eval.batch_size": 0}, "eval.batch_size"),
    ({"eval.temperature": -0.1}, "eval.temperature"),
    ({"eval.top_p": 1.5}, "eval.top_p"),
    ({"eval.judge_prompt": "Is {question} answered?"}, "eval.judge_prompt"),  # no {completion}
    ({"eval.judge_prompt": "{completion} {solution}"}, "eval.judge_prompt"),  # unknown field
    ({"eval.judge_prompt": "{completion"}, "eval.judge_prompt"),  # unmatched brace
    ({"eval.every": -1}, "eval.every"),
    ({"rl.ratio_cap": 1.1}, "rl.ratio_cap"),  # inside the clip range 1 + eps_high = 1.2
    ({"rl.dual_clip": 0.5}, "rl.dual_clip"),
    ({"rl.top_entropy_frac": 1.5}, "rl.top_entropy_frac"),
    ({"rl.baseline": "median"}, "rl.baseline"),
    ({"rl.adv_scale": "std"}, "rl.adv_scale"),
    (
        {
            "sampling.temperature_schedule.kind": "piecewise",
            "sampling.temperature_schedule.boundaries": (2, 4),
            "sampling.temperature_schedule.levels": (1.0, 0.5),
        },
        "sampling.temperature_schedule.levels",
    ),
    (
        {
            "sampling.position_schedule.kind": "piecewise",
            "sampling.position_schedule.boundaries": (4, 2),
            "sampling.position_schedule.levels": (1.0, 0.9, 0.8),
        },
        "sampling.position_schedule.boundaries",
    ),
    (
        {"sampling.position_schedule.kind": "cosine", "sampling.position_schedule.end": 0.0},
        "sampling.position_schedule.end",
    ),
    ({"rl.max_staleness": -1}, "rl.max_staleness"),
    ({"rl.max_staleness": 1, "rl.stale_batches": "skip"}, "rl.stale_batches"),
    ({"rl.stale_batches": "drop"}, "rl.stale_batches"),  # no lag: nothing to drop
    ({"rl.max_staleness": 1, "rl.lag_correction": "is"}, "rl.lag_correction"),
    ({"rl.max_staleness": 1, "rl.lag_cap": 0.9}, "rl.lag_cap"),
    ({"rl.max_staleness": 1, "rl.lag_floor": 0.0}, "rl.lag_floor"),
    ({"rl.max_staleness": 1, "rl.tis_cap": 2.0}, "rl.tis_cap"),  # the same ratio twice
    ({"rl.max_staleness": 1, "mesh.num_processes": 2}, "mesh.num_processes"),
    ({"mesh.sampler_devices": 2}, "mesh.sampler_devices"),  # a synchronous sampler
    ({"mesh.sampler_devices": -1, "rl.max_staleness": 1}, "mesh.sampler_devices"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD_OVERRIDES)
def test_bad_values_name_the_key(overrides, key):
    overrides = {"mesh.data": 4, **overrides}
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}")):
        load_config("tiny", overrides)


def test_unknown_keys_and_wrong_types_in_a_config_file():
    cfg = base.get_config()  # unlocked, as inside a config file's get_config()
    cfg.rl.bta = 0.1
    with pytest.raises(ConfigError, match=r"unknown config key 'rl.bta' \(did you mean 'beta'\?\)"):
        to_train_config(cfg)
    cfg = base.get_config()
    cfg.optim.lr = None  # ConfigDict lets None through; the schema does not
    with pytest.raises(ConfigError, match="config key 'optim.lr' must be float, got None"):
        to_train_config(cfg)
    cfg = base.get_config()
    cfg.extra = ConfigDict({"a": 1})
    with pytest.raises(ConfigError, match="unknown config key 'extra'"):
        to_train_config(cfg)
    with pytest.raises(ConfigError, match="unknown config key 'sampling.top_q'"):
        load_config("tiny", {"sampling.top_q": 0.9})
    with pytest.raises(ConfigError, match="'rl.beta'"):
        load_config("tiny", {"rl.beta": "high"})
    with pytest.raises(ConfigError, match=r"key 'eval.judge_sorce' \(did you mean 'judge_source'"):
        load_config("tiny", {"eval.judge_sorce": "tiny"})
    with pytest.raises(ConfigError, match="'eval.num_samples'"):
        load_config("tiny", {"eval.num_samples": 2.5})


def test_eval_section_defaults_are_the_seed_study_settings():
    ev = load_config("gsm8k_hard", {"eval.judge_prompt": "{question}? {completion}"}).eval
    assert (ev.num_samples, ev.max_new_tokens, ev.temperature, ev.top_p) == (8, 512, 0.6, 0.95)
    assert ev.judge_source == "" and ev.judge_prompt == "{question}? {completion}"
    assert load_config("tiny").eval.judge_prompt == JUDGE_PROMPT


def test_mesh_fits_devices():
    cfg = load_config("tiny", {"mesh.data": -1, "mesh.tensor": 2})
    assert resolve_mesh_shape(cfg, 8) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="config key 'mesh'"):
        resolve_mesh_shape(load_config("tiny", {"mesh.tensor": 3}), 8)
    with pytest.raises(ConfigError, match="divisible by mesh data \\* fsdp = 16"):
        resolve_mesh_shape(cfg, 32)


def test_the_sampler_devices_split_the_slice():
    """mesh.sampler_devices = N: the learner's mesh over the rest, the sampler's keeping the
    tensor axis; a split leaving the learner nothing, or not a multiple of the tensor axis,
    is one line naming the key."""
    lag = {"rl.max_staleness": 1, "mesh.data": -1}
    cfg = load_config("tiny", {**lag, "mesh.sampler_devices": 4, "mesh.tensor": 2})
    learner = resolve_mesh_shape(cfg, 8)
    assert learner == {"data": 2, "fsdp": 1, "tensor": 2}
    assert sampler_mesh_shape(cfg, learner) == {"data": 2, "fsdp": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="'mesh.sampler_devices' = 8: leaves the learner no"):
        resolve_mesh_shape(load_config("tiny", {**lag, "mesh.sampler_devices": 8}), 8)
    odd = load_config("tiny", {**lag, "mesh.sampler_devices": 3, "mesh.tensor": 1})
    odd_tensor = load_config("tiny", {**lag, "mesh.sampler_devices": 3, "mesh.tensor": 2})
    assert sampler_mesh_shape(odd, {"data": 5, "fsdp": 1, "tensor": 1})["data"] == 3
    with pytest.raises(ConfigError, match="'mesh.sampler_devices' = 3: must be a multiple"):
        sampler_mesh_shape(odd_tensor, {"data": 1, "fsdp": 1, "tensor": 2})


def test_layer_loop_auto_unrolls_full_fine_tuning_on_cpu_without_remat():
    def resolve(**overrides):
        spec = load_config("tiny", {f"model.{k}": v for k, v in overrides.items()}).model
        return model_fields(spec, "cpu")["layout"].unrolls_layers

    assert resolve(lora_rank=0, remat=False) and not resolve(lora_rank=8, remat=False)
    assert not resolve(lora_rank=0), "remat (the default) keeps the scan"
    assert resolve(lora_rank=8, layer_loop="unroll") and not resolve(lora_rank=0, layer_loop="scan")


def test_the_tiny_source_honours_model_remat_and_its_policy():
    def build(**overrides):
        cfg = load_config("tiny", {f"model.{k}": v for k, v in overrides.items()})
        return build_model(cfg.model, seed=0)[0].cfg

    default = build()
    assert default.remat and default.remat_policy == "full"
    assert build(remat_policy="projections").remat_policy == "projections"
    assert not build(remat=False).remat


def test_train_config_is_frozen_and_typed():
    cfg = load_config("gsm8k_curriculum", {"rl.grad_accum": 2, "optim.lr": 1})
    assert cfg.rl.batch_size == 128 and cfg.rl.microbatch_size == 64
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 1.0
    assert cfg.model.lora_targets == ("q", "k", "v", "o", "gate", "up", "down")
    assert cfg.rewards.functions[1][0] == "exact_answer"
    assert cfg.rewards.functions[1][1]["end_step"] == 100
    assert cfg.mesh.shape() == {"data": 1, "fsdp": -1, "tensor": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rl.beta = 0.0


def test_every_loss_preset_and_objective_option_is_reachable():
    """Every loss type the loss module owns validates, and a preset brings its advantage
    scaling unless the config names one."""
    for loss_type in LOSS_PRESETS:
        cfg = load_config("tiny", {"rl.loss_type": loss_type})
        assert cfg.rl.loss_type == loss_type
        assert cfg.rl.adv_scale == ("none" if loss_type == "dr_grpo" else "group"), loss_type
    explicit = load_config("tiny", {"rl.loss_type": "dr_grpo", "rl.adv_scale": "group"})
    assert explicit.rl.adv_scale == "group"
    options = {
        "rl.ratio_cap": 2.0,
        "rl.dual_clip": 3.0,
        "rl.top_entropy_frac": 0.2,
        "rl.baseline": "rloo",
        "rl.kl_bias_correction": True,
    }
    rl = load_config("tiny", options).rl
    assert (rl.ratio_cap, rl.dual_clip, rl.top_entropy_frac) == (2.0, 3.0, 0.2)
    assert rl.baseline == "rloo" and rl.kl_bias_correction


def test_piecewise_and_position_schedules_load():
    cfg = load_config(
        "tiny",
        {
            "sampling.temperature_schedule.kind": "piecewise",
            "sampling.temperature_schedule.boundaries": (2, 4),
            "sampling.temperature_schedule.levels": (1.2, 1.0, 0.7),
            "sampling.position_schedule.kind": "linear",
            "sampling.position_schedule.end": 0.5,
        },
    )
    assert cfg.sampling.temperature_schedule.levels == (1.2, 1.0, 0.7)
    assert cfg.sampling.position_schedule.kind == "linear"


def test_the_trainer_and_the_compiler_resolve_the_layer_loop_alike():
    """`jaxgrpo.compile` builds its model config as the trainer does (`settings.model`): full
    fine-tuning with remat keeps the scan on a CPU topology too."""
    for overrides in ({"lora_rank": 0, "remat": False}, {"lora_rank": 0}, {"lora_rank": 8}):
        cfg = load_config("tiny", {f"model.{k}": v for k, v in overrides.items()})
        model, _ = build_model(cfg.model, cfg.seed)
        assert model_config(cfg.model, "cpu") == model.cfg, overrides
    cfg = load_config("tiny", {"model.lora_rank": 0, "model.remat": False})
    assert not model_config(cfg.model, "tpu").layout.unrolls_layers, "auto unrolls on CPU only"
