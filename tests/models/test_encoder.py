"""The Flax BERT sentence encoder against transformers' PyTorch BertModel (all-MiniLM-L6-v2)."""

import numpy as np
import pytest

from jaxgrpo.models import encoder as enc

SENTENCES = [
    "The cat sat on the mat.",
    "Half of 48 is 24, so she sold 48 + 24 = 72 clips in April and May.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    "a",
    "Shall I compare thee to a summer's day? " * 40,  # > 256 tokens: exercises truncation.
    "Ünïcödé text, emoji 🙂 and numbers 3.14159 mixed together.",
]


@pytest.fixture(scope="module")
def minilm():
    try:
        path = enc.default_encoder_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from jaxgrpo.rewards.embedding import load_encoder

    encoder = load_encoder()  # The embedding reward's cached instance: loaded once per run.
    # One batch of 6 rows padded to 8 and to the 256-token bucket, shared by the tests below.
    return path, encoder, encoder.encode(SENTENCES)


def test_matches_torch_bert_mean_pooling(minilm):
    """Cosine(ours, torch) >= 0.9999 per sentence, and our tokenization equals the HF one."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, encoder, ours = minilm

    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = hf_tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    ids, mask = encoder.tokenize(SENTENCES)
    for i in range(len(SENTENCES)):
        n = int(batch["attention_mask"][i].sum())
        assert ids[i, :n].tolist() == batch["input_ids"][i, :n].tolist(), SENTENCES[i][:40]
        assert mask[i].sum() == n

    model = transformers.BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"][:, :, None].float()
    ref = (h * m).sum(1) / m.sum(1)
    ref = torch.nn.functional.normalize(ref, dim=-1).numpy()

    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    cos = (ours * ref).sum(-1)
    assert cos.min() >= 0.9999, f"cosine vs torch per sentence: {cos}"
    np.testing.assert_allclose(ours, ref, atol=2e-4)


def test_padding_and_batching_do_not_change_embeddings(minilm):
    """A sentence embedded alone equals the same sentence padded inside a larger batch."""
    _, encoder, together = minilm
    alone = np.concatenate([encoder.encode([s]) for s in SENTENCES[:2]])
    np.testing.assert_allclose(together[:2], alone, atol=1e-5)
    assert encoder.encode([]).shape == (0, 384)


def test_loader_names_missing_and_misshaped_tensors():
    cfg = enc.EncoderConfig(
        vocab_size=50,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        intermediate_size=16,
        max_position_embeddings=32,
    )
    model = enc.BertEncoder(cfg, seed=0)
    layout = enc._hf_layout(model)
    tensors = {
        name: (np.asarray(p[...]).T if t else np.asarray(p[...])) for name, (p, t) in layout.items()
    }
    enc.load_bert_weights(model, {"bert." + k: v for k, v in tensors.items()})
    missing = dict(tensors)
    del missing["encoder.layer.0.output.dense.bias"]
    with pytest.raises(ValueError, match="encoder.layer.0.output.dense.bias"):
        enc.load_bert_weights(model, missing)
    bad = dict(tensors, **{"embeddings.word_embeddings.weight": np.zeros((49, 8))})
    with pytest.raises(ValueError, match="word_embeddings.*shape"):
        enc.load_bert_weights(model, bad)
