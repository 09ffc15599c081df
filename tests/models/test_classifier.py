"""The sequence classifier (a reward model's port): scores equal transformers'
``AutoModelForSequenceClassification`` on tiny random checkpoints of each family under left and
right padding, 8 devices equal 1, bfloat16 stays close to float32, and each bad checkpoint fails
with one line naming it before anything compiles.

Parity tolerance: float32 scores within max|ours - torch| <= 1e-4 * max|torch|.
"""

import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402
from tiny_hf import ARCHS  # noqa: E402

from jaxgrpo.core import sharding  # noqa: E402
from jaxgrpo.core.errors import UserError  # noqa: E402
from jaxgrpo.models.classifier import (  # noqa: E402
    CheckpointError,
    abstract_classifier,
    classifier_config,
    last_token_index,
    load_classifier,
    scoring_program,
)
from jaxgrpo.models.tiny import TINY_VOCAB, tiny_tokenizer  # noqa: E402

PAD = 0  # tiny_hf's pad_token_id


def write_classifier(path, arch, *, auto=None, seed=0, **overrides):
    """save_pretrained of a random tiny classifier (one label unless overridden) with the tiny
    tokenizer, whose ids fit its embedding; returns the torch model."""
    torch.manual_seed(seed)
    config = ARCHS[arch](**{"vocab_size": TINY_VOCAB, "num_labels": 1, **overrides})
    ref = (auto or transformers.AutoModelForSequenceClassification).from_config(config).eval()
    ref.save_pretrained(path)
    tiny_tokenizer().hf.save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{arch: (directory, torch model)}."""
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(f"rm_{arch}"))
        out[arch] = (path, write_classifier(path, arch))
    return out


def padded_batch(rows: int = 6, length: int = 12):
    """Random ids with PAD in padding: unpadded, left-padded, right-padded rows, a one-token
    row, and a row whose last real token is the pad id (read as padding by transformers)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, TINY_VOCAB, (rows, length)).astype(np.int32)
    mask = np.ones_like(ids)
    ids[1, :5], mask[1, :5] = PAD, 0  # left padding
    ids[2, 8:], mask[2, 8:] = PAD, 0  # right padding
    ids[3, 1:], mask[3, 1:] = PAD, 0  # one token
    ids[4, 6] = PAD  # a real token equal to the pad id, inside the row
    ids[5, 9], ids[5, 10:], mask[5, 10:] = PAD, PAD, 0  # ... and as its last real token
    return ids, mask


def ours(model, ids, mask):
    return np.asarray(scoring_program(model)(nnx.split(model)[1], ids, mask))


def theirs(ref, ids, mask):
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
    return out.logits[:, 0].float().numpy()


def assert_close(a, b, rtol=1e-4):
    err = np.abs(a - b).max() / np.abs(b).max()
    assert err <= rtol, f"relative score error {err:.2e} > {rtol}: {a} vs {b}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_scores_match_transformers(dirs, arch):
    path, ref = dirs[arch]
    model, tokenizer = load_classifier(path)
    assert model.backbone.cfg.arch == arch and model.backbone.lm_head is None
    assert model.cfg.pad_id == PAD and tokenizer.vocab_size <= TINY_VOCAB
    assert classifier_config(path, layout=model.backbone.cfg.layout) == model.cfg
    ids, mask = padded_batch()
    assert_close(ours(model, ids, mask), theirs(ref, ids, mask))


def test_last_token_is_the_rightmost_non_pad_id():
    ids, mask = padded_batch()
    np.testing.assert_array_equal(last_token_index(ids, mask, PAD), [11, 11, 7, 0, 11, 8])
    # Without a pad id, the mask says which tokens are real.
    np.testing.assert_array_equal(last_token_index(ids, mask, None), [11, 11, 7, 0, 11, 9])


def test_eight_devices_equal_one(dirs):
    path, _ = dirs["qwen2"]
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    ids, mask = (np.concatenate([x, x[:2]]) for x in padded_batch())  # 8 rows: batch-sharded
    one, _ = load_classifier(path)
    eight, _ = load_classifier(path, mesh=mesh)
    assert eight.score.get_value().sharding.spec == PartitionSpec(None, "fsdp")
    assert len(eight.backbone.layers.attn.q.kernel.get_value().sharding.device_set) == 8
    program = scoring_program(eight, mesh)
    state = nnx.split(eight)[1]
    scores8 = program(state, *(sharding.put_batch(x, mesh) for x in (ids, mask)))
    assert scores8.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(scores8), ours(one, ids, mask), rtol=1e-5, atol=1e-5)


def test_bfloat16_scores_stay_close(dirs):
    path, ref = dirs["llama"]
    model, _ = load_classifier(path, dtype="bfloat16")
    assert model.score.get_value().dtype == jax.numpy.bfloat16
    ids, mask = padded_batch()
    scores = ours(model, ids, mask)
    assert scores.dtype == np.float32
    assert_close(scores, theirs(ref, ids, mask), rtol=0.05)


def test_scoring_program_lowers_from_the_abstract_model(dirs):
    """What an ahead-of-time compile needs: the config alone, no weights."""
    dtypes = dict(dtype="bfloat16", param_dtype="bfloat16")
    model = abstract_classifier(classifier_config(dirs["qwen3"][0], **dtypes))
    ids = jax.ShapeDtypeStruct((4, 16), jax.numpy.int32)
    text = scoring_program(model).lower(nnx.split(model)[1], ids, ids).as_text()
    (main,) = [line for line in text.splitlines() if "func.func public @main" in line]
    assert "tensor<1x64xbf16>" in main and "-> (tensor<4xf32>" in main, main


def test_pad_id_from_the_tokenizer(dirs):
    path, _ = dirs["llama"]
    model, tokenizer = load_classifier(path, pad_id="tokenizer")
    assert model.cfg.pad_id == tokenizer.pad_id == tokenizer.hf.pad_token_id


def _error(source, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_classifier(source, **kwargs)
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_bad_checkpoints_fail_with_one_line(dirs, tmp_path):
    missing = str(tmp_path / "nope")
    assert f"reward model directory {missing} does not exist" in _error(missing)
    causal = str(tmp_path / "causal")
    write_classifier(causal, "llama", auto=transformers.AutoModelForCausalLM)
    message = _error(causal)
    assert "LlamaForCausalLM" in message and "config.json" in message
    assert "supported: LlamaForSequenceClassification, Qwen2ForSequenceClassification, " in message
    two = str(tmp_path / "two")  # transformers writes no id2label for its default of two
    write_classifier(two, "qwen3", num_labels=2)
    assert "2 labels ('score.weight' has 2 rows)" in _error(two)
    three = str(tmp_path / "three")
    write_classifier(three, "qwen3", num_labels=3)
    assert "config.json: 3 labels (num_labels / id2label)" in _error(three)
    headless = str(tmp_path / "headless")
    write_classifier(headless, "llama")
    weights = os.path.join(headless, "model.safetensors")
    tensors = load_file(weights)
    del tensors["score.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    assert "no score head ('score.weight')" in _error(headless)
    no_config = str(tmp_path / "empty")
    os.makedirs(no_config)
    assert "No config.json" in _error(no_config)


def test_random_preset_classifiers_for_compile_checks():
    """`random:<name>`: a one-label classifier of a preset's shape with random weights and the
    tiny tokenizer; an unknown name is refused in one line listing the known ones."""
    model, tokenizer = load_classifier("random:SmolLM2-135M", pad_id="tokenizer")
    assert model.cfg.backbone.hidden_size == 576 and model.cfg.pad_id == tokenizer.pad_id
    ids = np.asarray([tokenizer.hf.encode("Copy this: 12")], np.int32)
    scores = np.asarray(model(ids, np.ones_like(ids)))
    assert scores.shape == (1,) and np.isfinite(scores).all()
    with pytest.raises(CheckpointError, match=r"unknown architecture 'Nope'.*SmolLM2-135M"):
        classifier_config("random:Nope")
