"""Greedy ``generate`` equals ``transformers`` greedy ``generate`` token for token: tiny random
Llama (llama3 rope scaling), Qwen2 (qkv bias, tied embeddings), Qwen3 (qk-norm), and the real
SmolLM2-135M-Instruct GGUF with its chat template. Left-padded prompts of different lengths."""

import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from tiny_hf import ARCHS  # noqa: E402

from jaxgrpo.models.config import ModelConfig  # noqa: E402
from jaxgrpo.models.transformer import Transformer  # noqa: E402
from jaxgrpo.models.weights import load_hf_tensors  # noqa: E402
from jaxgrpo.sampling import StopReason, generate  # noqa: E402


def _prompts(lengths, p, vocab, seed=0):
    """Left-padded random prompts (ids >= 3, so no pad/bos/eos inside) of the given lengths."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), p), np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, p - n :] = rng.integers(3, vocab, n)
        mask[b, p - n :] = 1
    return ids, mask


def _hf_greedy(hf, ids, mask, new, eos_ids, pad_id):
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=new,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_id,
        )
    hf_new = out[:, ids.shape[1] :].numpy()
    return np.pad(hf_new, ((0, 0), (0, new - hf_new.shape[1])), constant_values=pad_id)


def _assert_same(ours, hf_new, eos_ids):
    """Same tokens wherever ours is unmasked; after a stop token HF pads, as do we."""
    tokens = np.asarray(ours.tokens)
    m = np.asarray(ours.mask).astype(bool)
    np.testing.assert_array_equal(np.where(m, tokens, -1), np.where(m, hf_new, -1))
    stopped = np.asarray(ours.stop_reason) == StopReason.STOP_TOKEN
    last = np.asarray(ours.lengths) - 1
    assert np.all(np.isin(tokens[np.arange(len(tokens)), last][stopped], eos_ids))


@pytest.mark.parametrize("cache_sizes", [None, (4, 7, 10)], ids=["default", "grown"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers_tiny(arch, cache_sizes):
    """Also with a completion cache grown through three sizes."""
    torch.manual_seed(0)
    hf_cfg = ARCHS[arch]()
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    sd = hf.state_dict()
    load_hf_tensors(model, lambda n: sd[n].float().numpy())
    ids, mask = _prompts([5, 16, 9], 16, cfg.vocab_size)
    new, eos = 10, (2, 7)
    ours = generate(
        model, ids, mask, rng=jax.random.key(0), max_new_tokens=new, temperature=0.0,
        eos_ids=eos, cache_sizes=cache_sizes,
    )  # fmt: skip
    _assert_same(ours, _hf_greedy(hf, ids, mask, new, eos, 0), eos)
    assert np.asarray(ours.mask).sum() >= 10, "too few tokens compared to prove anything"


@pytest.mark.slow
def test_greedy_matches_transformers_smollm2(smollm2_gguf):
    """The real model through ``load_model(gguf)`` against transformers' own GGUF import of the
    same file (dequantised to float32), chat-templated prompts of different lengths, 16 tokens."""
    from jaxgrpo.models import load_model

    model, tok = load_model(smollm2_gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf),
        gguf_file=os.path.basename(smollm2_gguf),
        dtype=torch.float32,
    ).eval()
    chats = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Write one short sentence about the sea and the wind."}],
        [{"role": "user", "content": "Hi"}],
    ]
    ids, mask = tok.encode_chat(chats)
    assert len(set(mask.sum(1))) == 3, "prompts must have different lengths"
    new = 16
    ours = generate(
        model,
        ids,
        mask,
        rng=jax.random.key(0),
        max_new_tokens=new,
        temperature=0.0,
        eos_ids=tok.eos_ids,
        pad_id=tok.pad_id,
    )
    hf_new = _hf_greedy(
        hf, ids.astype(np.int64), mask.astype(np.int64), new, tok.eos_ids, tok.pad_id
    )
    _assert_same(ours, hf_new, tok.eos_ids)
    assert np.asarray(ours.mask).sum() >= 16, "expected real completions, not instant stops"
