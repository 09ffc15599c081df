"""Asynchronous rollouts in the ahead-of-time compile (``jaxgrpo.planning.split``): with
``mesh.sampler_devices`` the sampler's programs are lowered on the slice's last devices over
its own copy of the weights and the learner's on the rest; the report's weight transfer is
the trainable params' bytes, and its split step is max(sampler, learner) + transfer. A
sampler side that cannot hold its weights, or a split leaving the learner nothing, is
refused in one line before anything compiles.

The tiny config on the test process's 8 virtual CPU devices (``cpu-8``) splits 4 + 4; one
test compiles the sampler for a v5e-8 split when libtpu is installed.
"""

import importlib.util
import math
import os

import jax
import numpy as np
import pytest

from jaxgrpo.core.presets import CHIPS
from jaxgrpo.planning import aot, memory, split
from jaxgrpo.planning import compile as compile_cli
from jaxgrpo.settings.loading import load_config
from jaxgrpo.settings.model import model_config

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[tpu]'): no TPU compiler to test",
)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
SPLIT = {"rl.max_staleness": 1, "mesh.sampler_devices": 4}
MESH = {"mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1}  # what compile_config sets


def _compile(topology, overrides, only):
    """(programs, report) of the tiny config: ``compile_config``'s steps, keeping the
    compiled programs for their shardings."""
    preset = compile_cli._preset(topology)
    cfg = load_config("tiny", {**MESH, **overrides})
    programs, facts = aot.compile_step(cfg, preset, 256, only)
    return programs, compile_cli.report(cfg, programs, facts, preset), cfg


@pytest.fixture(scope="module")
def split_cpu8():
    return _compile("cpu-8", SPLIT, ("sample", "score", "update"))


def _devices(compiled) -> set:
    """Every device a compiled program's arguments and results live on."""
    trees = (compiled.input_shardings, compiled.output_shardings)
    return set().union(*(s.device_set for s in jax.tree.leaves(trees)))


def _trainable_bytes(cfg, platform="cpu") -> int:
    m = model_config(cfg.model, platform)
    return memory.trainable_param_count(m) * np.dtype(m.param_dtype).itemsize


def test_each_side_compiles_on_its_own_devices(split_cpu8):
    programs, rep, _ = split_cpu8
    devices = jax.devices()[:8]
    learner, sampler = set(devices[:4]), set(devices[4:])
    sides = {p.name: p.side for p in programs}
    assert sides == {
        "sample/prefill": "sampler", "sample/decode": "sampler",
        "score (ref/old)": "learner", "update": "learner",
    }  # fmt: skip
    for p in programs:
        assert _devices(p.compiled) == (sampler if p.side == "sampler" else learner), p.name
        assert p.devices == 4
    f = rep["facts"]
    assert f["sampler"]["device_ids"] == [d.id for d in devices[4:]]
    assert f["sampler"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert f["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and f["learner_devices"] == 4
    assert [r["side"] for r in rep["programs"]] == ["sampler", "sampler", "learner", "learner"]


def test_the_transfer_is_the_lora_adapters_and_the_step_the_slower_side(split_cpu8):
    programs, rep, cfg = split_cpu8
    sp = rep["split"]
    assert sp["transfer"]["bytes"] == _trainable_bytes(cfg)  # the adapters alone
    assert sp["transfer"]["bytes"] < memory.base_param_count(model_config(cfg.model, "cpu"))
    # each sampler chip receives its shard; CPU's nominal ICI, one direction
    r = sp["transfer"]["bytes_per_sampler_chip"]
    assert sp["transfer"]["estimate_s"] == pytest.approx(r / (CHIPS["cpu"].ici_bw / 2))
    sides = [sum(x["estimate_s"] * x["calls"] for x in rep["programs"] if x["side"] == s)
             for s in ("sampler", "learner")]  # fmt: skip
    want = max(sides) + sp["transfer"]["estimate_s"]
    assert sp["estimate_s"] == pytest.approx(want) == rep["step"]["estimate_s"]
    # one version (k = 1) is the programs' own argument: nothing else stays beside them
    sampled = [p for p in programs if p.side == "sampler"]
    assert all(p.resident_bytes == 0 for p in sampled)
    text = compile_cli.render(rep)
    assert "| sample/decode | sampler |" in text and "Weight transfer per update" in text
    assert "LoRA adapters" in text and "Estimated split step: max(sampler" in text


def test_full_fine_tuning_transfers_every_weight():
    """Nothing compiled (``only=()``): the facts alone hold the transfer's bytes."""
    cfg = load_config("tiny", {**MESH, **SPLIT, "model.lora_rank": 0})
    programs, facts = aot.compile_step(cfg, compile_cli._preset("cpu-8"), 256, ())
    assert programs == []
    base = memory.base_param_count(model_config(cfg.model, "cpu"))
    assert facts["transfer_bytes"] == _trainable_bytes(cfg) == base * 4  # float32


def test_a_lag_on_shared_devices_keeps_its_versions_resident():
    """k = 2 without sampler devices: two more copies of the adapters beside every program."""
    programs, rep, _ = _compile("cpu-8", {"rl.max_staleness": 2}, ("score",))
    per_chip = rep["facts"]["trainable_bytes_per_chip"]
    assert per_chip > 0 and "split" not in rep
    assert programs[0].resident_bytes == 2 * per_chip
    assert "rl.max_staleness=2 on shared devices: 2 extra copies" in compile_cli.render(rep)


def test_a_sampler_side_that_cannot_hold_its_weights_is_refused_in_one_line(capsys):
    """An 8B model in float32 over the sampler's fsdp = 4 CPU devices (2 GiB each)."""
    over = ["--config.model.source=random:Llama-3.1-8B", "--config.rl.max_staleness=1"]
    argv = ["--config", "tiny", "--topology", "cpu-8", *over, "--config.mesh.sampler_devices=4"]
    assert compile_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("error: mesh.sampler_devices: the sampler's 4 chips"), err
    assert "mesh.tensor" in err and "rl.max_staleness" in err


@pytest.mark.parametrize("n", [8, 9])
def test_a_split_leaving_the_learner_no_devices_is_refused_in_one_line(capsys, n):
    argv = ["--config", "tiny", "--topology", "cpu-8", "--config.rl.max_staleness=1"]
    assert compile_cli.main([*argv, f"--config.mesh.sampler_devices={n}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "mesh.sampler_devices" in err, err
    assert "leaves the learner no devices" in err


def test_the_synchronous_baseline_sits_beside_the_split():
    rep = {"facts": {"topology": "v5e-64", "model": "m"}, "split": {}}
    sync = {
        "facts": {"topology": "v5e-64", "model": "m", "devices": 64, "mesh": {"fsdp": 64}},
        "step": {"estimate_s": 3.0, "hbm_per_chip": 1, "compile_s": 5.0},
        "programs": [{"program": "update", "calls": 1, "estimate_s": 3.0, "memory": {}}],
    }
    split.compare(rep, sync, "compiled in this call")
    assert rep["split"]["synchronous"]["estimate_s"] == 3.0
    with pytest.raises(ValueError, match="--baseline"):
        split.compare(rep, {**sync, "facts": {**sync["facts"], "topology": "v5e-8"}}, "x")
    over = {"mesh.sampler_devices": 16, "rl.max_staleness": 1, "rl.stale_batches": "drop"}
    sync_over = split.synchronous_overrides({**over, "rl.beta": 0.0})
    assert sync_over == {"rl.max_staleness": 0, "rl.stale_batches": "wait", "rl.beta": 0.0}


@needs_libtpu
def test_a_v5e8_split_compiles_the_sampler_on_its_last_four_chips():
    programs, rep, _ = _compile("v5e-8", SPLIT, ("sample",))
    ids = [d.id for d in aot.topology_devices(compile_cli._preset("v5e-8"))]
    assert [p.name for p in programs] == ["sample/prefill", "sample/decode"]
    for p in programs:
        assert {d.id for d in _devices(p.compiled)} == set(ids[4:]) and p.side == "sampler"
    assert rep["facts"]["sampler"]["device_ids"] == ids[4:]
    assert rep["facts"]["sampler"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert rep["split"]["learner"]["estimate_s"] == 0  # no learner program asked for
    assert math.isclose(rep["split"]["estimate_s"], rep["split"]["sampler"]["estimate_s"]
                        + rep["split"]["transfer"]["estimate_s"])  # fmt: skip


@needs_libtpu
def test_a_side_the_compiler_refuses_is_one_line_before_the_step_compiles(capsys):
    """v5e-32 (limited ICI routing) refuses a program over part of the slice that holds its
    first chip: here the learner's 16 of 32; a trial sum finds it in seconds."""
    over = ["--config.rl.prompts_per_step=4", "--config.rl.max_staleness=1"]
    argv = ["--config", "tiny", "--topology", "v5e-32", *over, "--only", "update"]
    assert compile_cli.main([*argv, "--config.mesh.sampler_devices=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: mesh.sampler_devices: the compiler refuses a program over the "
                          "learner's 16 of v5e-32's 32 chips"), err  # fmt: skip
