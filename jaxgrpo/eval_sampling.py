"""Sampling for evaluation: completions of many prompts in fixed-shape batches over the mesh,
and a yes/no judge model (the config's ``eval.judge_source``, asked with ``eval.judge_prompt``).
Used by ``jaxgrpo.evaluate`` (and the Colab demo)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

JUDGE_PROMPT = (
    "Question:\n{question}\n\nReference answer: {reference}\n\nStudent's solution:\n"
    "{completion}\n\nDoes the student's solution reach the reference answer? "
    "Reply with one word: yes or no."
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Settings of an evaluation: the seed study's defaults, as the config's ``eval`` section
    (``jaxgrpo.evaluate`` builds this from it) plus the split, example cap and seed."""

    split: str = "test"
    num_samples: int = 8
    max_new_tokens: int = 512
    temperature: float = 0.6
    top_p: float = 0.95
    max_examples: int | None = None
    batch_size: int = 8
    seed: int = 0
    judge_source: str = ""
    judge_prompt: str = JUDGE_PROMPT


def _put(x: np.ndarray, mesh: Any):
    """A global array of a host batch that every process holds, rows over (data, fsdp)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    spec = PartitionSpec(("data", "fsdp")) if x.shape[0] % rows == 0 else PartitionSpec()
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def _host(x) -> np.ndarray:
    """The whole value of a (possibly multi-host) array on this host."""
    from jax.experimental import multihost_utils

    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def sample(model, tokenizer, messages: list, settings: Settings, mesh, *, greedy=False) -> dict:
    """Completions of every prompt, ``num_samples`` each (1 if greedy), in batches.

    Returns:
      ``texts`` [B * n], ``lengths``, ``truncated`` and ``tokens`` (lists of ids), grouped by
      prompt.
    """
    import jax

    from jaxgrpo.sampling import StopReason, generate

    n = 1 if greedy else settings.num_samples
    out: dict[str, list] = {"texts": [], "lengths": [], "truncated": [], "tokens": []}
    key = jax.random.key(settings.seed)
    for i, start in enumerate(range(0, len(messages), settings.batch_size)):
        chunk = messages[start : start + settings.batch_size]
        # A fixed batch shape (last batch padded with its final prompt) compiles once.
        padded = chunk + [chunk[-1]] * (settings.batch_size - len(chunk))
        ids, mask = tokenizer.encode_chat(padded)
        res = generate(
            model,
            _put(np.asarray(ids), mesh),
            _put(np.asarray(mask), mesh),
            rng=jax.random.fold_in(key, i),
            max_new_tokens=settings.max_new_tokens if not greedy else 4,
            temperature=0.0 if greedy else settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            eos_ids=tokenizer.eos_ids,
            num_samples=n,
            pad_id=tokenizer.pad_id,
        )
        keep = len(chunk) * n
        tokens, tmask = _host(res.tokens)[:keep], _host(res.mask)[:keep]
        out["texts"] += tokenizer.batch_decode(tokens, tmask)
        out["lengths"] += tmask.sum(-1).tolist()
        out["truncated"] += (_host(res.stop_reason)[:keep] == int(StopReason.LENGTH)).tolist()
        out["tokens"] += [t[m > 0].tolist() for t, m in zip(tokens, tmask, strict=True)]
    return out


def judge_messages(examples, completions, num_samples: int, prompt: str) -> list:
    """The judge's chat for each completion: one user message, ``prompt`` filled in.

    Args:
      examples: [B] task examples (their last user message is the question, ``answer`` the
        reference); completions: [B * num_samples] texts grouped by prompt.
      prompt: template with ``{question}``, ``{reference}`` and ``{completion}``.
    """
    messages = []
    for i, text in enumerate(completions):
        ex = examples[i // num_samples]
        question = next(m["content"] for m in reversed(ex["messages"]) if m["role"] == "user")
        content = prompt.format(question=question, reference=ex.get("answer"), completion=text)
        messages.append([{"role": "user", "content": content}])
    return messages


def judge(judge_model, judge_tokenizer, examples, completions, settings, mesh, prompt=None):
    """bool per completion: the judge's greedy reply (4 tokens) starts with the word "yes".

    Args:
      judge_model / judge_tokenizer: any ``load_model`` model (an instruct model).
      examples / completions: as for ``judge_messages``.
      prompt: the template; None = ``settings.judge_prompt`` (the config's ``eval.judge_prompt``).
    """
    prompt = prompt or settings.judge_prompt
    messages = judge_messages(examples, completions, settings.num_samples, prompt)
    replies = sample(judge_model, judge_tokenizer, messages, settings, mesh, greedy=True)
    return [judge_says_yes(r) for r in replies["texts"]]


@dataclasses.dataclass
class Judge:
    """``settings.judge_source`` loaded once; called as ``judge(examples, completions)`` it gives
    a yes/no verdict per completion, asked with ``settings.judge_prompt``."""

    model: Any
    tokenizer: Any
    settings: Settings
    mesh: Any

    def __call__(self, examples: list, completions: list[str]) -> list[bool]:
        return judge(self.model, self.tokenizer, examples, completions, self.settings, self.mesh)


def make_judge(cfg: Any, settings: Settings, mesh: Any) -> Judge:
    """The judge of ``settings`` (built like the policy: ``cfg.model``'s dtypes, no LoRA)."""
    from jaxgrpo.train import build_model

    spec = dataclasses.replace(cfg.model, source=settings.judge_source, lora_rank=0)
    model, tokenizer = build_model(spec, cfg.seed, mesh)
    return Judge(model, tokenizer, settings, mesh)


def judge_says_yes(reply: str) -> bool:
    """The reply's first word is "yes" (any case, punctuation after it allowed)."""
    return re.match(r"\W*yes\b", reply, re.IGNORECASE) is not None
