"""LoRA: B = 0 is the base model, merge() is exact, only adapters get gradients, PEFT export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models import lora as lora_lib
from jaxgrpo.models.config import LoRAConfig, ModelConfig
from jaxgrpo.models.construct import random_model
from jaxgrpo.models.weights import hf_tensors, peft_adapter_config, peft_lora_tensors

CFG = ModelConfig(
    arch="llama", vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8,
)  # fmt: skip
LORA = LoRAConfig(rank=4, alpha=8.0)
IDS = (np.arange(20, dtype=np.int32).reshape(2, 10) * 7) % 128
MASK = np.array([[0, 0, 0] + [1] * 7, [1] * 10], np.int32)


@jax.jit
def _logits(model):
    return model(IDS, attention_mask=MASK)


def _with_base(lora_cfg, base):
    """A LoRA model whose base weights are `base`'s and whose adapters have random B."""
    model = random_model(CFG.replace(lora=lora_cfg), seed=1)
    nnx.update(model, nnx.state(base, nnx.Param))
    return model


def _randomise_b(model, seed=2):
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, lora_lib.LoRA):
            b = node.lora_b[...]
            node.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(b.shape), b.dtype)


@pytest.fixture(scope="module")
def base():
    return random_model(CFG)


def test_untrained_adapters_reproduce_the_base_model_exactly(base):
    model = _with_base(LORA, base)
    assert isinstance(model.layers.attn.q.lora.lora_b, nnx.LoRAParam)
    np.testing.assert_array_equal(np.asarray(_logits(model)), np.asarray(_logits(base)))


def test_merge_equals_unmerged_and_zeroes_b(base):
    model = _with_base(LORA, base)
    _randomise_b(model)
    unmerged = np.asarray(_logits(model))
    assert np.abs(unmerged - np.asarray(_logits(base))).max() > 1e-3, "adapters must matter"
    merged_tensors = hf_tensors(model, merge_lora=True)  # on a copy: model stays unmerged
    np.testing.assert_array_equal(np.asarray(_logits(model)), unmerged)
    lora_lib.merge(model)
    np.testing.assert_allclose(np.asarray(_logits(model)), unmerged, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(model.layers.mlp.gate_lora.lora_b[...]))
    for name, value in hf_tensors(model, merge_lora=False).items():
        np.testing.assert_allclose(value, merged_tensors[name], rtol=1e-6, atol=1e-6)


def test_only_lora_params_get_gradients_and_zero_lora_is_the_reference(base):
    model = _with_base(LORA, base)
    _randomise_b(model)
    graphdef, lora, base_state = nnx.split(model, nnx.LoRAParam, nnx.Param)
    base_paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(base_state)
    ]
    assert base_paths and not any("lora" in p for p in base_paths)

    @jax.jit
    def loss(lora, base_state):
        logits = nnx.merge(graphdef, lora, base_state)(IDS, attention_mask=MASK)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    grads = jax.grad(loss)(lora, base_state)
    assert jax.tree.structure(grads) == jax.tree.structure(lora)
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)}
    assert paths and all("lora_a" in p or "lora_b" in p for p in paths), paths
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))

    reference = lora_lib.zero_lora(lora)
    ref_model = nnx.merge(graphdef, reference, base_state)
    np.testing.assert_array_equal(np.asarray(_logits(ref_model)), np.asarray(_logits(base)))
    a_before = model.layers.attn.q.lora.lora_a[...]
    np.testing.assert_array_equal(np.asarray(ref_model.layers.attn.q.lora.lora_a[...]), a_before)


def test_targets_select_projections():
    model = random_model(CFG.replace(lora=LoRAConfig(rank=2, targets=("q", "v", "up"))))
    attn, mlp = model.layers.attn, model.layers.mlp
    assert attn.q.lora is not None and attn.v.lora is not None and mlp.up_lora is not None
    assert attn.k.lora is None and attn.o.lora is None and mlp.gate_lora is None
    assert mlp.down.lora is None
    assert attn.q.lora.lora_a.get_metadata("logical_axes") == ("layers", "embed", "lora_rank")
    with pytest.raises(ValueError, match="Unknown LoRA targets"):
        LoRAConfig(targets=("qkv",))


def test_peft_export_loads_in_peft_with_the_same_logits(base):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = _with_base(LORA, base)
    _randomise_b(model)
    hf_cfg = transformers.LlamaConfig(**{
        k: v for k, v in model.cfg.to_hf_config().items() if k not in ("architectures",)
    })  # fmt: skip
    tm = transformers.LlamaForCausalLM(hf_cfg).eval()
    tm.load_state_dict(
        {k: torch.tensor(v) for k, v in hf_tensors(model, merge_lora=False).items()}, strict=True
    )
    conf = peft_adapter_config(model.cfg)
    pm = peft.get_peft_model(
        tm,
        peft.LoraConfig(
            r=conf["r"], lora_alpha=conf["lora_alpha"], target_modules=conf["target_modules"],
            lora_dropout=0.0,
        ),
    )  # fmt: skip
    tensors = peft_lora_tensors(model)
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (
        4,
        32,
    )
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)
    result = peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in tensors.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    with torch.no_grad():
        ref = pm(torch.tensor(IDS).long(), attention_mask=torch.tensor(MASK)).logits.numpy()
    valid = MASK.astype(bool)
    np.testing.assert_allclose(np.asarray(_logits(model))[valid], ref[valid], rtol=1e-4, atol=1e-4)


def test_low_rank_delta_gradients_equal_autodiff_of_the_plain_formula():
    """The hand-written backward (dA = (g^T x)^T) equals autodiff of `scale * (x A) B`."""
    kx, ka, kb, ky = jax.random.split(jax.random.key(3), 4)
    x, a = jax.random.normal(kx, (37, 24)), jax.random.normal(ka, (24, 4))
    b, dy = jax.random.normal(kb, (4, 40)), jax.random.normal(ky, (37, 40))

    def plain(x, a, b):
        return jnp.sum(2.5 * (x @ a) @ b * dy)

    def ours(x, a, b):
        return jnp.sum(lora_lib.low_rank_delta(x, a, b, 2.5) * dy)

    np.testing.assert_allclose(ours(x, a, b), plain(x, a, b), rtol=1e-5)
    want = jax.grad(plain, argnums=(0, 1, 2))(x, a, b)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(x, a, b)
    for name, g, w in zip("xab", got, want, strict=True):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4, err_msg=f"d{name}")
