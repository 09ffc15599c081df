"""The ``exact_answer`` reward: the seed study's hard reward, 1 when the answer inside the
``<answer>`` tag the model wrote equals the reference, else 0, compared by ``jaxgrpo.grading``.
With tools, only the model's own text is graded (``model_completions``): a tool's output cannot
supply the answer."""

from __future__ import annotations

from jaxgrpo.grading.answers import extract_answer, graded_texts, reference_answer
from jaxgrpo.grading.verify import MATH_VERIFY, verify_answer

__all__ = ["MATH_VERIFY", "exact_answer"]


def exact_answer(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list,
    verifier: list | None = None,
    model_completions: list[str] | None = None,
    **_,
) -> list[float | None]:
    """Hard correctness reward.

    ``r_i = 1[verify_answer(extract_answer(c_i), reference_answer(a_i), verifier_i)]``: 1.0 when
    the content of the completion's last ``<answer>`` tag equals the reference answer, else 0.0.
    An answer stated only in the reasoning (no tags) scores 0. The reference may be a bare
    answer, a GSM8K solution (``#### 42``) or a boxed solution. A missing (None or empty)
    reference scores None. This is strict correctness (``jaxgrpo.rl.accuracy``).

    Args:
      prompts: [N] prompt strings (unused).
      completions: [N] completion strings (or TRL's messages).
      answer: [N] references (str or number).
      verifier: [N] the task's ``verifier`` column (``MATH_VERIFY`` or None); None = fast path.
      model_completions: [N] what the model wrote, without the tools' results (the column
        ``RewardSet`` passes); graded instead of ``completions`` when given.

    Returns:
      [N] floats in {0.0, 1.0}, or None where the reference is missing.
    """
    del prompts
    verifiers = verifier if verifier is not None else [None] * len(completions)
    rewards: list[float | None] = []
    texts = graded_texts(completions, model_completions)
    for text, ref, kind in zip(texts, answer, verifiers, strict=True):
        if ref is None or not str(ref).strip():
            rewards.append(None)
            continue
        pred = extract_answer(text)
        rewards.append(float(verify_answer(pred, reference_answer(str(ref)), kind)))
    return rewards
