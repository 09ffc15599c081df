"""Sharding: rule tables, the committed PartitionSpec dump, and 8 devices == 1 device."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxgrpo.core import host, sharding
from jaxgrpo.models import source_config
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.construct import random_model
from jaxgrpo.models.kv_cache import init_cache
from jaxgrpo.models.transformer import Transformer

DUMP = pathlib.Path(__file__).parent / "models" / "sharding_specs.txt"
CFG = ModelConfig(
    arch="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, lora=LoRAConfig(rank=4),
)  # fmt: skip


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "conftest.py must set 8 virtual CPU devices"
    return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def test_logical_to_spec_and_unknown_names():
    rules = sharding.TRAIN_RULES
    assert sharding.logical_to_spec(("layers", "embed", "heads", "head_dim"), rules) == P(
        None, "fsdp", "tensor", None
    )
    assert sharding.logical_to_spec(("act_batch", "act_length"), rules) == P(("data", "fsdp"), None)
    # Sampling keeps weights whole across fsdp (no all-gather per decode step).
    assert sharding.logical_to_spec(("vocab", "embed"), sharding.SAMPLE_RULES) == P("tensor", None)
    with pytest.raises(ValueError, match="'bogus'"):
        sharding.logical_to_spec(("embed", "bogus"), rules)


def test_sampling_layout_by_model_and_slice():
    """Replicated over data x fsdp where the weights fit (Qwen2.5-1.5B on v5e-8, Llama-3.1-8B
    with v5e-64's tensor=4), tensor-parallel over fsdp x tensor where only that split fits
    (Llama-3.1-8B on v5e-8: 16 GB of bfloat16 weights, 2 GB a chip), else the training
    layout; the tensor-parallel rules split heads over both axes and rows over data only."""
    from jaxgrpo.core import presets
    from jaxgrpo.planning import flops

    def layout(model: str, slice_name: str) -> str:
        preset = presets.get_preset(slice_name)
        weights = flops.weight_bytes(source_config(model, dtype="bfloat16"))
        return sharding.sampling_layout(preset.mesh, weights, preset.hbm_bytes)

    assert layout("Qwen2.5-1.5B", "v5e-8") == "sample"
    assert layout("Llama-3.1-8B", "v5e-64") == "sample"
    assert layout("Llama-3.1-8B", "v5e-8") == "sample_tp"
    assert sharding.sampling_layout({"data": 8, "fsdp": 1, "tensor": 1}, 16e9, 16e9) == "train"
    tp = sharding.SAMPLE_TP_RULES
    assert sharding.logical_to_spec(("embed", "heads"), tp) == P(None, ("fsdp", "tensor"))
    assert sharding.logical_to_spec(("act_batch", "act_vocab"), tp) == P("data", ("fsdp", "tensor"))
    assert sharding.rules_name(tp) == "sample_tp"


def test_make_mesh_fills_and_validates():
    mesh = sharding.make_mesh({"tensor": 2, "data": -1})
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert dict(sharding.make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.make_mesh({"data": 2, "tensor": 2})
    with pytest.raises(ValueError, match="Unknown mesh axes"):
        sharding.make_mesh({"model": 8})


def test_indivisible_dims_are_replicated(mesh):
    """3 kv heads cannot split over tensor=2: that dim is replicated rather than failing."""
    spec = sharding.logical_to_spec(("embed", "kv_heads"), sharding.TRAIN_RULES, (32, 3), mesh)
    assert spec == P("fsdp", None)


def _dump(mesh) -> str:
    abstract = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    lines = []
    for name, rules in (
        ("TRAIN_RULES", sharding.TRAIN_RULES),
        ("SAMPLE_RULES", sharding.SAMPLE_RULES),
        ("SAMPLE_TP_RULES", sharding.SAMPLE_TP_RULES),
    ):
        lines.append(f"# {name} on mesh {dict(mesh.shape)}")
        specs = sharding.param_specs(nnx.state(abstract), rules, mesh)
        shapes = nnx.state(abstract)
        for (path, spec), (_, shape) in zip(
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)),
            jax.tree_util.tree_leaves_with_path(shapes),
            strict=True,
        ):
            names = (str(getattr(k, "key", getattr(k, "name", k))) for k in path)
            key = ".".join(n for n in names if n != "value")
            lines.append(f"{key} {tuple(shape.shape)} {spec}")
    return "\n".join(lines) + "\n"


def test_partition_specs_match_committed_dump(mesh):
    text = _dump(mesh)
    if os.environ.get("JAXGRPO_UPDATE_SHARDING_DUMP"):
        DUMP.write_text(text)
    assert DUMP.exists(), "run with JAXGRPO_UPDATE_SHARDING_DUMP=1 to create the dump"
    assert text == DUMP.read_text(), (
        "Parameter shardings changed. If intended, regenerate with "
        "JAXGRPO_UPDATE_SHARDING_DUMP=1 pytest tests/test_sharding.py and commit the diff."
    )


def test_eight_devices_equal_one(mesh):
    """Same weights: sharded (TRAIN_RULES, activations constrained) vs single-device forward,
    and a sharded cached prefill + decode step. Tolerance 1e-5."""
    model = random_model(CFG, 3, mesh=mesh, rules=sharding.TRAIN_RULES)
    q = model.layers.attn.q.kernel[...]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    graphdef, state = nnx.split(model)
    single = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
    single.shard_ctx = None

    ids = jnp.asarray((np.arange(64).reshape(8, 8) * 5) % 128, jnp.int32)
    mask = jnp.ones((8, 8), jnp.int32).at[1, :3].set(0)

    @jax.jit
    def run(m):
        full = m(ids, attention_mask=mask)
        cache = init_cache(m.cfg, 8, 10)
        _, cache = m.prefill(ids[:, :7], mask[:, :7], cache)
        h, _ = m.prefill(ids[:, 7:], jnp.ones((8, 1), jnp.int32), cache)
        return full, m.logits(h)

    full8, step8 = run(model)
    assert len(full8.sharding.device_set) == 8
    full1, step1 = run(single)
    np.testing.assert_allclose(np.asarray(full8), np.asarray(full1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(step8), np.asarray(step1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(step1)[:, 0], np.asarray(full1)[:, 7], atol=1e-5)


def test_shard_act_without_ctx_and_single_process_init():
    x = jnp.ones((2, 3))
    assert sharding.shard_act(x, ("act_batch", "act_embed"), None) is x
    assert host.initialize_distributed() is False
