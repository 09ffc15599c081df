"""The reward registry: names configs use, and lookup by name, dotted path or callable."""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxgrpo.core.dotted import import_dotted
from jaxgrpo.rewards.bleu import bleu
from jaxgrpo.rewards.code import code_tests
from jaxgrpo.rewards.embedding import embedding
from jaxgrpo.rewards.format import format_copy, format_r1, format_strict
from jaxgrpo.rewards.hybrid import embedding_bleu, hard_soft
from jaxgrpo.rewards.length import length_penalty, repetition_penalty
from jaxgrpo.rewards.math import exact_answer
from jaxgrpo.rewards.sonnet import sonnet_form, sonnet_lines, sonnet_meter, sonnet_rhyme


def _perplexity(prompts, completions, **kwargs):
    # Imported on first use: the perplexity reward runs the base model.
    from jaxgrpo.rewards.perplexity import perplexity

    return perplexity(prompts, completions, **kwargs)


REWARDS: dict[str, Callable[..., list]] = {
    "exact_answer": exact_answer,
    "format": format_strict,
    "format_r1": format_r1,
    "format_copy": format_copy,
    "bleu": bleu,
    "embedding": embedding,
    "perplexity": _perplexity,
    "embedding_bleu": embedding_bleu,
    "hard_soft": hard_soft,
    "sonnet_lines": sonnet_lines,
    "sonnet_rhyme": sonnet_rhyme,
    "sonnet_meter": sonnet_meter,
    "sonnet_form": sonnet_form,
    "code_tests": code_tests,
    "length_penalty": length_penalty,
    "repetition_penalty": repetition_penalty,
}


def reward_name(target: str | Callable) -> str:
    """The name a reward is reported under: its registry name, dotted path, or ``__name__``."""
    if isinstance(target, str):
        return target
    for name, fn in REWARDS.items():
        if fn is target:
            return name
    return getattr(target, "__name__", type(target).__name__)


def get_reward(target: str | Callable, **kwargs) -> Callable[..., list]:
    """A reward function by registry name, dotted path (``"my_pkg.rewards.fn"`` or
    ``"my_pkg.rewards:fn"``), or a callable, with ``kwargs`` bound (``functools.partial``).

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    if callable(target):
        fn = target
    elif target in REWARDS:
        fn = REWARDS[target]
    elif "." in target or ":" in target:
        try:
            fn = import_dotted(target)
        except ImportError as error:
            raise ValueError(f"cannot import reward function {target!r}: {error}") from error
    else:
        raise ValueError(
            f"unknown reward {target!r}; known: {sorted(REWARDS)} (or a dotted path "
            "'package.module.function')"
        )
    if not kwargs:
        return fn
    bound = functools.partial(fn, **kwargs)
    bound.__name__ = reward_name(target)
    return bound
