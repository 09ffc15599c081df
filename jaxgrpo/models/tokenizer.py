"""Tokenizer: a Hugging Face fast tokenizer, its chat template, left padding and length buckets.

Prompts go to the sampler as int32 ``[B, P]`` arrays, left-padded so that every row's last prompt
token sits at the same index and decoding writes one cache slot for all rows. ``P`` is rounded up
to a power of two (at least ``min_bucket``) so the number of distinct prompt shapes, hence of
compiled programs, stays logarithmic in the prompt length.

The tokenizer comes from a Hugging Face directory (``tokenizer.json`` plus the chat template in
``tokenizer_config.json`` / ``chat_template.jinja``) or is rebuilt from a GGUF file's metadata by
``hf_tokenizer_from_gguf_metadata``, which reproduces llama.cpp's pre-tokenizer for the file's
``tokenizer.ggml.pre`` type.

``check_same_tokenizer`` refuses a second model (a teacher) whose ids mean other tokens than
the policy's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from jaxgrpo.core.errors import ConfigError
from jaxgrpo.models.gguf import GGUFCheckpoint

# Tokens that end an assistant turn in the chat formats we support; each one present in the
# vocabulary is a stop token in addition to the tokenizer's own eos.
CHAT_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp `tokenizer.ggml.pre` -> the regex splits it applies before byte-level BPE, in order
# (llama-vocab.cpp). "smollm" and the StarCoder family isolate every digit first.
_PRE_SPLITS = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "codeshell": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
# llama.cpp keeps a pre-token whole when it is itself a vocabulary entry for these (Llama 3).
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> set[str]:
    """The 256 printable characters byte-level BPE spells bytes with (GPT-2's bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = 256 - len(keep)
    return {chr(b) for b in keep} | {chr(256 + n) for n in range(extra)}


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers  # heavy (Rust bindings); GGUF files only

    if pre not in _PRE_SPLITS:
        raise ValueError(
            f"Unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(_PRE_SPLITS))}."
        )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def hf_tokenizer_from_gguf_metadata(meta: Callable):
    """Build a ``transformers`` fast tokenizer from GGUF ``tokenizer.ggml.*`` metadata.

    Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen, SmolLM)
    are supported; sentencepiece files (Llama 2) should be loaded from a Hugging Face directory.

    Args:
      meta: ``meta(key, default=None)`` returning a metadata value (``GGUFCheckpoint.meta``).

    Returns:
      A ``transformers.PreTrainedTokenizerFast`` with the file's special tokens and chat template.
    """
    # tokenizers and transformers are heavy to import; only GGUF files need them here
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    kind = meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"Unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE). "
            "Load this model from a Hugging Face directory instead."
        )
    pre = meta("tokenizer.ggml.pre", "default")
    tokens = meta("tokenizer.ggml.tokens")
    types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES)
    raw = RawTokenizer(bpe)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = _pre_tokenizer(pre)
    raw.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: skip it.
    alphabet = _byte_alphabet()
    raw.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL and set(t) <= alphabet
        ]
    )
    raw.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )

    def token(key):
        index = meta(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    bos = token("bos_token_id")
    if meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta("tokenizer.chat_template"),
        add_bos_token=bool(meta("tokenizer.ggml.add_bos_token", False)),
    )


def bucket_length(
    n: int, min_bucket: int = 16, max_length: int | None = None, half_octaves: bool = False
) -> int:
    """The padded length for ``n`` tokens: the next power of two, at least ``min_bucket``.

    With ``half_octaves`` the buckets are 2^k and 3 * 2^(k-1) (64, 96, 128, 192, ...): at most
    a third of a row is padding instead of half, for twice as many shapes to compile.
    Capped at ``max_length`` when given (``n`` must then fit).
    """
    bucket = max(min_bucket, 1 << max(n - 1, 0).bit_length())
    if half_octaves and bucket > min_bucket and 3 * bucket // 4 >= max(n, min_bucket):
        bucket = 3 * bucket // 4
    return bucket if max_length is None else min(bucket, max_length)


class Tokenizer:
    """A Hugging Face fast tokenizer with chat rendering and left-padded, bucketed batches.

    Attributes:
      hf: the wrapped ``transformers`` tokenizer.
      eos_ids: tuple of stop token ids: eos, chat end tokens in the vocabulary, and any extra ids
        (e.g. ``generation_config.json``'s ``eos_token_id``), deduplicated, eos first.
      pad_id: the padding id (the tokenizer's pad token, else the first eos id).
      min_bucket: smallest padded length ``encode``/``encode_chat`` produce.
    """

    def __init__(self, hf, *, extra_eos_ids: Sequence[int] = (), min_bucket: int = 16):
        self.hf = hf
        self.min_bucket = min_bucket
        vocab = hf.get_vocab()
        ids = [hf.eos_token_id] + [vocab.get(t) for t in CHAT_END_TOKENS] + list(extra_eos_ids)
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
        if not self.eos_ids:
            raise ValueError("Tokenizer has no eos token and no known chat end token.")
        self.pad_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_ids[0]

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> Tokenizer:
        """Load from a Hugging Face directory; adds ``generation_config.json`` eos ids."""
        from transformers import AutoTokenizer  # heavy to import: only when loading one

        path = os.fspath(path)
        extra = list(kwargs.pop("extra_eos_ids", ()))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            extra += [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(AutoTokenizer.from_pretrained(path), extra_eos_ids=extra, **kwargs)

    @classmethod
    def from_gguf(cls, source, **kwargs) -> Tokenizer:
        """Rebuild from a GGUF file (a path or a ``GGUFCheckpoint``)."""
        ckpt = source if isinstance(source, GGUFCheckpoint) else GGUFCheckpoint(source)
        return cls(hf_tokenizer_from_gguf_metadata(ckpt.meta), **kwargs)

    def __len__(self) -> int:
        return len(self.hf)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """Render one conversation (``[{"role": ..., "content": ...}, ...]``) to text; with
        ``tools`` (JSON schemas), as the template describes them (TRL's ``tools=``; None or
        ``[]``: none, as TRL passes ``tools or None``)."""
        if not self.hf.chat_template:
            raise ValueError("This tokenizer has no chat template; use encode() on plain text.")
        return self.hf.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool = True,
        min_bucket: int | None = None,
        max_length: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize a batch, left-padded to a power-of-two bucket.

        Args:
          texts: B strings.
          add_special_tokens: let the tokenizer add bos etc. (False for rendered chat text,
            whose template already wrote them).
          min_bucket: smallest padded length (default ``self.min_bucket``).
          max_length: longest allowed row; a longer row raises rather than being cut.

        Returns:
          ``(ids_BP, mask_BP)``: int32 ids (``pad_id`` in padding) and int32 mask, 1 on tokens.
        """
        rows = [self.hf.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        longest = max((len(r) for r in rows), default=0)
        if max_length is not None and longest > max_length:
            row = next(i for i, r in enumerate(rows) if len(r) == longest)
            raise ValueError(f"Row {row} has {longest} tokens, more than max_length={max_length}.")
        length = bucket_length(longest, min_bucket or self.min_bucket, max_length)
        ids_BP = np.full((len(rows), length), self.pad_id, dtype=np.int32)
        mask_BP = np.zeros((len(rows), length), dtype=np.int32)
        for b, row in enumerate(rows):
            if row:
                ids_BP[b, length - len(row) :] = row
                mask_BP[b, length - len(row) :] = 1
        return ids_BP, mask_BP

    def encode_chat(
        self,
        conversations: Sequence[list[dict]],
        add_generation_prompt: bool = True,
        tools: Sequence[list[dict] | None] | None = None,
        **kwargs,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Render each conversation with the chat template, then ``encode`` (no added bos).

        Args:
          conversations: B message lists.
          add_generation_prompt: end with the assistant header so the model answers.
          tools: None, or B tool-schema lists (or None) the template describes per
            conversation (``jaxgrpo.agents.Agent.prompt_tools``).
          **kwargs: ``min_bucket`` / ``max_length`` as in ``encode``.

        Returns:
          ``(ids_BP, mask_BP)`` as in ``encode``.
        """
        tools = [None] * len(conversations) if tools is None else tools
        texts = [
            self.apply_chat_template(m, add_generation_prompt, t)
            for m, t in zip(conversations, tools, strict=True)
        ]
        return self.encode(texts, add_special_tokens=False, **kwargs)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of one sequence of ids (list or 1-D array)."""
        return self.hf.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, ids_BT, mask_BT=None, skip_special_tokens: bool = True) -> list[str]:
        """Texts of a batch; positions where ``mask_BT`` is 0 are dropped first."""
        ids_BT = np.asarray(ids_BT)
        keep = np.ones(ids_BT.shape, bool) if mask_BT is None else np.asarray(mask_BT).astype(bool)
        rows = zip(ids_BT, keep, strict=True)
        return [self.decode(row[k], skip_special_tokens) for row, k in rows]

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json and the chat template to ``out_dir``."""
        self.hf.save_pretrained(os.fspath(out_dir))


def tokenizer_difference(a: Tokenizer, b: Tokenizer) -> str | None:
    """How ``b``'s ids differ from ``a``'s (the first differing id, or a special id), or None
    when every id names the same token and eos, bos and pad are the same ids."""
    tokens_a = {i: t for t, i in a.hf.get_vocab().items()}
    tokens_b = {i: t for t, i in b.hf.get_vocab().items()}
    if tokens_a != tokens_b:
        i = min(i for i in tokens_a.keys() | tokens_b.keys() if tokens_a.get(i) != tokens_b.get(i))
        return (
            f"{len(tokens_a)} vs {len(tokens_b)} tokens, id {i} is "
            f"{tokens_a.get(i)!r} vs {tokens_b.get(i)!r}"
        )
    for name, x, y in (
        ("eos", a.hf.eos_token_id, b.hf.eos_token_id),
        ("bos", a.bos_id, b.bos_id),
        ("pad", a.pad_id, b.pad_id),
    ):
        if x != y:
            return f"{name} id {x} vs {y}"
    return None


def check_same_tokenizer(
    policy_tok: Tokenizer,
    other_tok: Tokenizer,
    *,
    policy_source: str,
    other_source: str,
    key: str = "teacher.source",
) -> None:
    """Refuses a second model whose tokenizer is not the policy's.

    A model that scores the policy's samples reads the policy's token ids, so each id must name
    the same token in both vocabularies, with the same special ids. How text splits into tokens
    is not compared: the second model never tokenizes text. A GGUF and a Hugging Face export of
    one model therefore match.

    Raises:
      ConfigError: one line naming ``key``, both sources and the first difference.
    """
    difference = tokenizer_difference(policy_tok, other_tok)
    if difference is not None:
        raise ConfigError(
            f"config key {key!r}: the tokenizer of {other_source!r} is not the policy's "
            f"({policy_source!r}): {difference}; both models must share one tokenizer"
        )
