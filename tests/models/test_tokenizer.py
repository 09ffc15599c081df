"""Tokenizer: buckets, left padding, chat rendering, eos ids, and rebuilding from GGUF metadata."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from test_load_export import CHATML, TEXTS, tiny_hf_tokenizer  # noqa: E402

from jaxgrpo.models.tokenizer import (  # noqa: E402
    Tokenizer,
    bucket_length,
    hf_tokenizer_from_gguf_metadata,
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(tiny_hf_tokenizer())


def gguf_metadata(hf, pre="gpt2"):
    """The `tokenizer.ggml.*` metadata llama.cpp's converter writes for a byte-level BPE."""
    data = json.loads(hf.backend_tokenizer.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {a["content"] for a in data["added_tokens"]}
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [t for t, _ in vocab],
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t, _ in vocab],
        "tokenizer.ggml.merges": [" ".join(m) for m in data["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": hf.convert_tokens_to_ids("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": hf.convert_tokens_to_ids("<|endoftext|>"),
        "tokenizer.chat_template": CHATML,
    }
    return lambda key, default=None: meta.get(key, default)


def test_bucket_length():
    assert [bucket_length(n) for n in (0, 1, 16, 17, 33, 64, 65)] == [16, 16, 16, 32, 64, 64, 128]
    assert bucket_length(5, min_bucket=4) == 8
    assert bucket_length(100, max_length=96) == 96
    half = [bucket_length(n, 16, half_octaves=True) for n in (1, 16, 17, 24, 25, 33, 87, 97)]
    assert half == [16, 16, 24, 24, 32, 48, 96, 128]


def test_encode_left_pads_to_bucket(tok):
    ids, mask = tok.encode(TEXTS, min_bucket=8)
    rows = [tok.hf.encode(t) for t in TEXTS]
    longest = max(map(len, rows))
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    assert ids.shape == (len(TEXTS), bucket_length(longest, 8))
    for b, row in enumerate(rows):
        n = len(row)
        assert mask[b].sum() == n and mask[b, -n:].all(), "tokens must sit at the right end"
        assert ids[b, -n:].tolist() == row
        assert (ids[b, : ids.shape[1] - n] == tok.pad_id).all()
    assert tok.batch_decode(ids, mask) == TEXTS
    with pytest.raises(ValueError, match=r"Row 1 has \d+ tokens, more than max_length=4"):
        tok.encode(TEXTS, max_length=4)


def test_encode_chat_and_eos(tok):
    conversations = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[0]}],
        [{"role": "user", "content": TEXTS[1]}],
    ]
    text = tok.apply_chat_template(conversations[0])
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"
    ids, mask = tok.encode_chat(conversations)
    assert tok.decode(ids[0][mask[0] == 1], skip_special_tokens=False) == text
    vocab = tok.hf.get_vocab()
    # eos first, then every chat end token in the vocabulary, no duplicates.
    assert tok.eos_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    assert tok.pad_id == vocab["<|endoftext|>"]


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_rebuilt_from_gguf_metadata(pre):
    """gpt2/smollm match the trained tokenizer exactly (its splits are GPT-2's, digits aside)."""
    hf = tiny_hf_tokenizer()
    rebuilt = hf_tokenizer_from_gguf_metadata(gguf_metadata(hf, pre))
    assert len(rebuilt) == len(hf) and rebuilt.chat_template == CHATML
    for text in TEXTS + ["<|im_start|>user\nhello<|im_end|>", "  spaced   out\n\n"]:
        ids = rebuilt.encode(text)
        assert rebuilt.decode(ids) == text
        if pre == "gpt2":
            assert ids == hf.encode(text), text
    pieces = [p for p, _ in rebuilt.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a 2024")]
    # llama.cpp's smollm isolates every digit; GPT-2 keeps " 2024" whole; Qwen2 one digit each.
    expected = {
        "gpt2": ["a", "\u01202024"],
        "smollm": ["a", "\u0120", "2", "0", "2", "4"],
        "qwen2": ["a", "\u0120", "2", "0", "2", "4"],
        "llama-bpe": ["a", "\u0120", "202", "4"],
    }
    assert pieces == expected[pre]


def test_rebuild_errors():
    hf = tiny_hf_tokenizer()
    with pytest.raises(ValueError, match="Unsupported GGUF pre-tokenizer 'nope'"):
        hf_tokenizer_from_gguf_metadata(gguf_metadata(hf, "nope"))
    meta = gguf_metadata(hf)
    with pytest.raises(ValueError, match="Unsupported GGUF tokenizer model 'llama'"):
        hf_tokenizer_from_gguf_metadata(
            lambda k, d=None: "llama" if k == "tokenizer.ggml.model" else meta(k, d)
        )


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_gguf):
    import os

    ours = Tokenizer.from_gguf(smollm2_gguf)
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf)
    )
    strings = [
        "Hello world!",
        "123 4567 x12 3.14159",
        "  two  spaces\n\nnew line\ttab",
        "I'm DON'T ünïcödé 日本語 🙂",
        "<|im_start|>user\nhi<|im_end|>",
        "x=1+2*3; print(f'{x:>10}')",
    ]
    for s in strings:
        assert ours.hf.encode(s) == ref.encode(s), s
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    ]
    for messages in conversations:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
    assert ours.eos_ids[0] == ref.eos_token_id == 2 and len(ours) == len(ref) == 49152
