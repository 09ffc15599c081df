"""Ahead-of-time compilation for TPU slices that are not here (``jaxgrpo.planning.compile``).

libtpu (the ``tpu`` extra) compiles for a TPU topology description on a CPU; the tests build
the tiny config's step for a one-host v5e-8 and a four-host v5e-16 and read the reports: their
fields, the arguments against parameter bytes worked out from the rules, the decode loop's
collectives under each sampling layout, the per-device parameter shapes, and an oversized run's
verdict. A ``cpu-8`` compile needs no libtpu.
"""

import importlib.util
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.core import presets, sharding
from jaxgrpo.models import source_config
from jaxgrpo.models.tiny import tiny_model_config
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.planning import aot, memory
from jaxgrpo.planning import compile as compile_cli
from jaxgrpo.planning import hlo as hlo_text
from jaxgrpo.sampling.resume import APPEND

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[tpu]'): no TPU compiler to test",
)
# Another process may hold libtpu's lockfile; compiling for a topology needs no chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
FIELDS = ("arguments", "outputs", "temporaries", "generated_code", "aliased", "total")


@pytest.fixture(scope="module")
def v5e8():
    return compile_cli.compile_config("tiny", "v5e-8", {})


@pytest.fixture(scope="module")
def v5e16():
    over = {"rl.prompts_per_step": 4}  # 16 rows: one per device
    return compile_cli.compile_config("tiny", "v5e-16", over, only=("sample",))


def _program(rep, name):
    return next(p for p in rep["programs"] if p["program"] == name)


def _shard_bytes(shape, dtype, names, mesh_shape) -> int:
    """Bytes of one device's shard, from the rule table by hand: each named dimension is
    divided by the size of the mesh axes its rule names, when they divide it."""
    split = 1
    rules = dict(sharding.TRAIN_RULES)
    for dim, name in zip(shape, names, strict=True):
        axes = rules.get(name) if name else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        size = math.prod(mesh_shape[a] for a in axes)
        split *= size if dim % size == 0 else 1
    return math.prod(shape) // split * np.dtype(dtype).itemsize


@needs_libtpu
def test_tiny_compiles_for_one_host_v5e8(v5e8):
    facts, step = v5e8["facts"], v5e8["step"]
    assert (facts["platform"], facts["devices"], facts["hosts"]) == ("tpu", 8, 1)
    names = [p["program"] for p in v5e8["programs"]]
    assert names == [
        "sample/prefill", "sample/decode", "score (ref/old)", "update", "eval/prefill",
        "eval/decode",
    ]  # fmt: skip
    for p in v5e8["programs"]:
        assert set(FIELDS) <= set(p["memory"]), p["program"]
        m = p["memory"]
        total = m["arguments"] + m["outputs"] + m["temporaries"] + m["generated_code"]
        assert m["total"] == total - m["aliased"]
        assert p["fits"] and p["suggestion"] is None and p["headroom_bytes"] > 0
        assert p["compile_s"] > 0 and p["flops"] > 0 and p["estimate_s"] > 0
    assert step["fits"] and step["hbm_per_chip"] == max(
        p["memory"]["total"] for p in v5e8["programs"]
    )
    assert 0 < step["mfu_estimate"] < 1
    assert "does NOT fit" not in compile_cli.render(v5e8)


def _prefill_argument_bytes(facts) -> int:
    """Prefill's arguments by hand: every parameter's shard, the prompts and the knobs."""
    from jaxgrpo.models.config import LoRAConfig

    cfg = tiny_model_config(LoRAConfig(rank=4, alpha=8.0))  # configs/tiny.py's adapters
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = 0
    for var in jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        value = var.get_value()
        names = var.get_metadata("logical_axes")
        params += _shard_bytes(value.shape, value.dtype, names, facts["mesh"])
    b, p = 2, facts["prompt_len"]
    n, t = b * 4, facts["max_new_tokens"]
    prompts = 2 * b * p * 4  # ids and mask, int32, replicated (2 rows do not split over 8)
    # temperature_NT, top_p, min_p, max_len_N, pad_id; not repetition_count: the tiny config
    # has no repetition guard, so the program never reads it and jit drops the argument.
    knobs = n * t * 4 + 4 + 4 + n * 4 + 4
    return params + prompts + knobs + 2 * 4  # and the uint32 [2] key


@needs_libtpu
def test_prefill_arguments_are_the_sharded_parameters_on_tpu(v5e8):
    """On TPU each array is stored in (8, 128)-element tiles (a scalar takes 512 bytes), so
    the tiny model's many small arrays take more than their elements; never less."""
    args = _program(v5e8, "sample/prefill")["memory"]["arguments"]
    hand = _prefill_argument_bytes(v5e8["facts"])
    assert hand <= args <= 4 * hand, (args, hand)


@needs_libtpu
def test_decode_step_has_no_collective_on_the_replicated_layout(v5e8, v5e16):
    for rep in (v5e8, v5e16):
        assert rep["facts"]["sample_rules"] == "sample"
        decode = _program(rep, "sample/decode")
        assert decode["loop_body_collectives"] == {}, decode["loop_body_collectives"]
        assert decode["while_loops"] >= 1


@needs_libtpu
def test_decode_step_on_training_weights_gathers_every_token(monkeypatch):
    """The same loop with the weights left fsdp-sharded: collectives at every token."""
    monkeypatch.setattr(sharding, "sampling_rules", lambda mesh, nbytes: sharding.TRAIN_RULES)
    rep = compile_cli.compile_config("tiny", "v5e-8", {"rl.group_size": 8}, only=("sample",))
    body = _program(rep, "sample/decode")["loop_body_collectives"]
    assert body.get("all-gather", {}).get("count", 0) > 0, body


@needs_libtpu
@pytest.mark.parametrize(
    "overrides, layout",
    [({"mesh.tensor": 2}, "sample"), ({"mesh.data": 4, "mesh.fsdp": 2}, "sample_tp")],
    ids=["tensor", "tensor-parallel-over-fsdp"],
)
def test_tensor_parallel_decode_step_only_reduces(monkeypatch, overrides, layout):
    """With tensor=2 (or, under ``SAMPLE_TP_RULES``, over fsdp=2: what an 8B model gets on
    v5e-8) the decode matrices are split Megatron-style (q/k/v and gate/up by output rows, o
    and down by input): a layer's collectives are two all-reduces of a few activation rows, no
    weight is gathered, and the logits move once to whole-vocabulary rows for sampling."""
    if layout == "sample_tp":
        monkeypatch.setattr(sharding, "sampling_rules", lambda m, n: sharding.SAMPLE_TP_RULES)
    overrides = {"rl.group_size": 8, **overrides}
    rep = compile_cli.compile_config("tiny", "v5e-8", overrides, only=("sample",))
    assert rep["facts"]["sample_rules"] == layout
    body = _program(rep, "sample/decode")["loop_body_collectives"]
    layers = tiny_model_config().num_layers
    assert body.get("all-reduce", {}).get("count", 0) >= 2 * layers, body
    weights = tiny_model_config().hidden_size * tiny_model_config().intermediate_size
    gathered = body.get("all-gather", {}).get("bytes", 0)
    assert gathered < weights, body  # activations or logits at most, never a weight matrix
    # the logits move once from vocabulary-split to row-split (whole vocabulary) for sampling
    assert body.get("all-to-all", {}).get("count", 0) <= 1 and "collective-permute" not in body


@needs_libtpu
def test_multi_host_parameter_shards_follow_the_rules(v5e16):
    """v5e-16 is four hosts; the abstract learner's parameters split embed over fsdp=16."""
    assert (v5e16["facts"]["hosts"], v5e16["facts"]["mesh"]["fsdp"]) == (4, 16)
    preset = presets.get_preset("v5e-16")
    devices = aot.topology_devices(preset)
    mesh = sharding.make_mesh(preset.mesh, devices)
    from jaxgrpo.settings.loading import load_config
    from jaxgrpo.settings.model import model_config

    cfg = load_config("tiny", {"mesh.fsdp": 16, "rl.prompts_per_step": 4})
    learner = aot.abstract_learner(cfg, mesh, model_config(cfg.model, "tpu"))
    frozen = learner.programs.frozen
    embed = frozen["embed"].get_value()
    assert embed.sharding.shard_shape(embed.shape) == (384, 64 // 16)
    q = frozen["layers"]["attn"]["q"]["kernel"].get_value()
    assert q.sharding.shard_shape(q.shape) == (2, 64 // 16, 4, 16)
    lora_b = learner.programs.params0["layers"]["attn"]["q"]["lora"]["lora_b"].get_value()
    assert lora_b.sharding.shard_shape(lora_b.shape) == lora_b.shape  # [L, R, N, H]: no embed


@needs_libtpu
def test_oversized_run_does_not_fit_and_names_a_knob():
    """A KV cache far beyond one v5e chip's 16 GiB: 8192 rows of 256 + 4096 slots."""
    over = {"rl.prompts_per_step": 512, "rl.group_size": 16, "sampling.max_new_tokens": 4096}
    rep = compile_cli.compile_config("tiny", "v5e-1", over, only=("sample",))
    decode = _program(rep, "sample/decode")
    assert not decode["fits"] and decode["headroom_bytes"] < 0
    assert "mesh.tensor" in decode["suggestion"] or "prompts_per_step" in decode["suggestion"]
    assert not rep["step"]["fits"]
    assert "does NOT fit" in compile_cli.render(rep)


def test_cpu_devices_compile_without_libtpu():
    """cpu-8: the test process's 8 virtual CPU devices (conftest), no libtpu involved."""
    rep = compile_cli.compile_config("tiny", "cpu-8", {}, only=("sample", "update"))
    assert rep["facts"]["platform"] == "cpu" and rep["facts"]["devices"] == 8
    assert [p["program"] for p in rep["programs"]] == ["sample/prefill", "sample/decode", "update"]
    assert _program(rep, "sample/decode")["loop_body_collectives"] == {}
    args = _program(rep, "sample/prefill")["memory"]["arguments"]
    assert args == _prefill_argument_bytes(rep["facts"])  # XLA:CPU stores arrays untiled


def test_a_run_with_tools_compiles_its_later_turns_sampler():
    """With the python tool the prompt grows by the tools' description, the first turn's decode
    keeps its cache, and ``continue`` resumes the whole batch (B * G = 16 rows, two per
    device) from it once per later turn: the rows' earlier ids stay in the cache, and only
    a chunk of the last kept id and a result is prefilled, in passes of ``APPEND`` ids, after
    the first turn's cache is laid out as the later turns' (``pack``)."""
    over = {"agent.tools": ("python",), "agent.max_turns": 3, "rl.group_size": 8}
    rep = compile_cli.compile_config("tiny", "cpu-8", over, 16, only=("sample", "continue"))
    f = rep["facts"]
    names = [p["program"] for p in rep["programs"]]
    assert names == [
        "sample/prefill", "sample/decode", "continue/pack", "continue/resume", "continue/decode"
    ]  # fmt: skip
    assert f["tool_prompt_tokens"] > 100, f  # the JSON block describing one tool
    p = f["prompt_len"]
    assert p == bucket_length(16 + f["tool_prompt_tokens"])
    # max_turns - 1 later turns, each of the passes of a 256-token result, bounded by T
    passes = -(-min(f["max_new_tokens"], 256 + APPEND) // APPEND)
    assert [x["calls"] for x in rep["programs"]] == [1, 1, 1, 2 * passes, 2]
    # The first turn's decode returns its cache, which the pack takes as an argument.
    prefill, decode, pack = (
        _program(rep, n)["memory"] for n in ("sample/prefill", "sample/decode", "continue/pack")
    )
    assert pack["arguments"] > prefill["arguments"] and decode["outputs"] > 0
    assert _program(rep, "continue/decode")["loop_body_collectives"] == {}
    assert "tool description" in compile_cli.render(rep)


def test_collectives_are_counted_per_loop_body_and_weighted_by_trips():
    hlo = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[16] {
  %ag = f32[16]{0} all-gather(f32[8]{0} %a), dimensions={0}
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[16]{0} copy(%ag)
}
"""
    out = hlo_text.collectives(hlo)
    assert out["loop_body"] == {"all-reduce": {"count": 1, "bytes": 32}}
    assert out["program"]["all-reduce"] == {"count": 5, "bytes": 160}
    assert out["program"]["all-gather"] == {"count": 1, "bytes": 64}
    assert out["loops"] == 1


def test_a_loop_inside_the_decode_loop_counts_per_trip():
    """The scan over layers inside a decode step: its collectives count L times per step."""
    hlo = """HloModule m

%layer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%step (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[16]{0} all-gather(f32[8]{0} %x), dimensions={0}
  %l = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%layer, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%step
  ROOT %r = f32[8]{0} copy(%a)
}
"""
    out = hlo_text.collectives(hlo, unknown_trips=10)
    assert out["loop_body"] == {
        "all-reduce": {"count": 3, "bytes": 96},
        "all-gather": {"count": 1, "bytes": 64},
    }
    assert out["program"]["all-reduce"] == {"count": 30, "bytes": 960}
    assert out["loops"] == 1


def test_a_scan_without_a_known_trip_count_is_counted_from_its_condition():
    """XLA:TPU leaves a lax.scan's while loop unannotated; its bound is the condition's
    ``counter < constant``."""
    hlo = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(7)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8]{0} copy(%a)
}
"""
    comps, entry = hlo_text._parse(hlo)
    line = next(x for op, _, x in comps[entry] if op == "while")
    assert hlo_text._counted_trips(comps, line) == 7


def test_every_table_slice_is_a_topology():
    for name in compile_cli.TABLE_SLICES + ("v5e-1", "v4-8", "v5p-8", "v6e-256"):
        p = presets.get_preset(name)
        assert p.topology and math.prod(p.mesh.values()) == p.devices
        assert p.specs.bf16_flops > 0 and p.specs.hbm_bw > 0 and p.specs.ici_bw > 0
    for name in compile_cli.TABLE_MODELS:
        assert name in presets.ARCHITECTURES


@pytest.mark.parametrize("slice_name", ["v5e-64", "v5p-128", "v6e-64"])
def test_every_gsm8k_config_validates_on_64_chip_slices(slice_name):
    """gsm8k_* configs share gsm8k_hard's model, batch and sampling shape, so gsm8k_hard's
    compile (``python -m jaxgrpo.compile --config gsm8k_hard --topology SLICE``) is theirs;
    each must pass the batch layout check on the preset mesh."""
    from jaxgrpo.settings.loading import load_config, shipped_configs
    from jaxgrpo.settings.schema import resolve_mesh_shape

    preset = presets.get_preset(slice_name)
    mesh = {f"mesh.{k}": v for k, v in preset.mesh.items()}
    hard = load_config("gsm8k_hard", mesh)
    names = [n for n in shipped_configs() if n.startswith("gsm8k_")]
    assert "gsm8k_hard" in names and len(names) > 1
    for name in names:
        cfg = load_config(name, mesh)
        assert resolve_mesh_shape(cfg, preset.devices) == preset.mesh
        for section in ("model", "rl", "mesh"):
            assert getattr(cfg, section) == getattr(hard, section), (name, section)
        assert cfg.sampling.max_new_tokens == hard.sampling.max_new_tokens, name


TEACHER = {"teacher.source": "random:SmolLM2-135M", "teacher.distill_coef": 1.0}


def test_a_teacher_compiles_its_scoring_pass_and_its_weights_stay_resident():
    """The teacher's pass is one more scoring program; its weights, sharded by the training
    rules, sit on every chip while the policy's programs run, and the policy's state while
    the teacher's runs."""
    rep = compile_cli.compile_config("tiny", "cpu-8", TEACHER, only=("score", "update"))
    names = [p["program"] for p in rep["programs"]]
    assert names == ["score (ref/old)", "score (teacher)", "update"]
    cfg = source_config("random:SmolLM2-135M")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    mesh = sharding.make_mesh(rep["facts"]["mesh"], jax.devices()[:8])
    state = nnx.state(model)
    shardings = sharding.param_shardings(state, mesh, sharding.TRAIN_RULES)
    want = sum(
        math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
    )
    teacher, update = _program(rep, "score (teacher)"), _program(rep, "update")
    assert update["memory"]["resident"] == want
    assert teacher["memory"]["arguments"] >= want and teacher["memory"]["resident"] > 0
    assert teacher["flops"] > 10 * _program(rep, "score (ref/old)")["flops"]
    second = rep["facts"]["second_models"]["teacher"]
    assert second == {"source": "random:SmolLM2-135M", "params": memory.base_param_count(cfg)}
    assert "teacher random:SmolLM2-135M (0.13 B, frozen)" in compile_cli.render(rep)


def test_a_teacher_that_cannot_fit_is_refused_in_one_line_before_compiling(capsys):
    over = ["--config.teacher.source=random:Llama-3.1-70B", "--config.teacher.distill_coef=1.0"]
    code = compile_cli.main(["--config", "tiny", "--topology", "cpu-8", *over])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: teacher.source: the teacher's weights") and "mesh.fsdp" in err


def test_a_reward_model_compiles_its_scoring_program_with_its_weights_resident():
    """`random:<name>` in rewards.functions: a one-label classifier of that shape scores the
    step's sequences `batch_size` at a time; its backbone stays on the chips beside the
    policy's programs."""
    rm = "random:SmolLM2-135M"
    over = {"rewards.functions": (("format_copy", 1.0), (rm, 0.5, {"batch_size": 4}))}
    rep = compile_cli.compile_config("tiny", "cpu-8", over, only=("score", "update"))
    names = [p["program"] for p in rep["programs"]]
    assert names == ["score (ref/old)", "score (reward_model[1])", "update"]
    scoring = _program(rep, "score (reward_model[1])")
    assert scoring["calls"] == 2  # 2 prompts x 4 samples, 4 rows a call
    resident = _program(rep, "update")["memory"]["resident"]
    assert resident == pytest.approx(scoring["memory"]["arguments"], rel=0.01)
    second = rep["facts"]["second_models"]["reward_model[1]"]
    assert second["source"] == rm and 1.0e8 < second["params"] < 1.4e8
    assert "reward_model[1] random:SmolLM2-135M" in compile_cli.render(rep)


def test_a_reward_model_that_cannot_fit_is_refused_naming_its_entry():
    over = {"rewards.functions": (("format_copy", 1.0), ("random:Llama-3.1-70B", 0.5))}
    with pytest.raises(ValueError, match=r"^rewards\.functions\[1\]: the reward_model\[1\]"):
        compile_cli.compile_config("tiny", "cpu-8", over, only=("score",))
