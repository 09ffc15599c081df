"""A yes/no judge: any ``load_model`` model (the config's ``eval.judge_source``) asked, greedily,
whether a completion reaches the reference, with the config's ``eval.judge_prompt``."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxgrpo.eval.completions import Settings, sample
from jaxgrpo.run.build import build_model


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
    spec = dataclasses.replace(cfg.model, source=settings.judge_source, lora_rank=0)
    model, tokenizer = build_model(spec, cfg.seed, mesh)
    return Judge(model, tokenizer, settings, mesh)


def judge_says_yes(reply: str) -> bool:
    """The reply's first word is "yes" (any case, punctuation after it allowed)."""
    return re.match(r"\W*yes\b", reply, re.IGNORECASE) is not None
