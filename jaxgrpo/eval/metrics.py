"""Pure evaluation figures: strict/lenient accuracy, format rate, pass@k, lengths, doom loops.

Everything here is a function of strings and numbers (no model, no JAX), so the figures that
``python -m jaxgrpo.evaluate`` reports are tested on hand-made completions.

Definitions (one prompt has ``n`` sampled completions; figures average over all samples unless
they say otherwise):

* strict / lenient / format: ``jaxgrpo.grading.accuracy`` (the one definition, shared with the
  training metrics), reported as ``strict_accuracy``, ``lenient_accuracy`` and ``format_rate``,
  of what the model wrote: with tools, an episode's text without the tools' results, so a
  tool's output never supplies the answer (pass@k and the tables follow from them).
* pass@k: the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)`` for ``c``
  strictly correct samples out of ``n``, averaged over prompts; mean@n is ``c / n`` averaged
  (so pass@1 = mean@n = strict_accuracy); ``lenient_pass@n`` counts lenient correctness.
* doom loop: the completion hit the length limit and its tail is one short block of tokens
  (or words) repeated many times, the ``</answer> </answer> ...`` failure of the seed study.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from jaxgrpo.grading.accuracy import FORMAT, LENIENT, STRICT, is_formatted, is_lenient, is_strict
from jaxgrpo.grading.answers import extract_answer

# A tail of >= _LOOP_REPEATS copies of one block of <= _LOOP_MAX_N tokens is a doom loop.
_LOOP_MAX_N = 8
_LOOP_REPEATS = 4


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (Chen et al. 2021), which never forms
    the binomials, so it stays exact in floating point for large n.

    Args:
      n: samples drawn for the prompt.
      c: how many of them are correct (0 <= c <= n).
      k: the budget (1 <= k <= n).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_all_k(correct_BG: np.ndarray) -> dict[int, float]:
    """``{k: mean over prompts of pass@k}`` for every k in 1..G.

    Args:
      correct_BG: bool [B, G], sample g of prompt b is correct.
    """
    g = correct_BG.shape[1]
    counts = correct_BG.sum(axis=1)
    return {k: float(np.mean([pass_at_k(g, int(c), k) for c in counts])) for k in range(1, g + 1)}


def tail_repeat(seq: Sequence[Hashable], max_n: int = _LOOP_MAX_N, repeats: int = _LOOP_REPEATS):
    """Whether ``seq`` ends in ``repeats`` or more consecutive copies of a block of <= max_n items.

    Args:
      seq: token ids or words.
      max_n: longest block length considered.
      repeats: copies needed.
    """
    seq = list(seq)
    for n in range(1, max_n + 1):
        span = n * repeats
        if span > len(seq):
            break
        tail = seq[-span:]
        if all(tail[i] == tail[i % n] for i in range(span)):
            return True
    return False


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """mean / median / p90 / max of completion lengths (NaN for an empty set)."""
    lengths = np.asarray(lengths, np.float64)
    if lengths.size == 0:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"), "max": 0.0}
    return {
        "mean": float(lengths.mean()),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "max": float(lengths.max()),
    }


def score_samples(
    completions: Sequence[str],
    references: Sequence[Any],
    num_samples: int,
    *,
    lengths: Sequence[int] | None = None,
    truncated: Sequence[bool] | None = None,
    tokens: Sequence[Sequence[int]] | None = None,
    verifiers: Sequence[str | None] | None = None,
    model_completions: Sequence[str] | None = None,
    model_tokens: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """One JSON-ready record per completion.

    Args:
      completions: [B * G] texts, grouped by prompt (prompt b -> rows b*G .. b*G+G-1).
      references: [B] reference answers.
      num_samples: G.
      lengths: [B * G] completion lengths in tokens (default: words).
      truncated: [B * G] hit the length limit (default: all False).
      tokens: [B * G] token ids for the loop check (default: words).
      verifiers: [B] the examples' ``verifier`` column (default: the fast path for all).
      model_completions: [B * G] what the model wrote of each completion (with tools: without
        the tools' results), which answer, strict, lenient and formatted grade (default: the
        completions).
      model_tokens: [B * G] ids the model drew of each (with tools): ``length`` counts them,
        ``tool_length`` the rest of ``lengths``.

    Returns:
      Dicts with prompt, sample, completion, reference, answer, length, truncated, strict,
      lenient, formatted, repeat (tail loop) and doom_loop (repeat and truncated); with
      ``model_tokens``, tool_length.
    """
    if len(completions) != len(references) * num_samples:
        raise ValueError(
            f"{len(completions)} completions for {len(references)} prompts x {num_samples} samples"
        )
    graded = list(completions) if model_completions is None else list(model_completions)
    if len(graded) != len(completions):
        raise ValueError(f"{len(graded)} model_completions for {len(completions)} completions")
    records = []
    for i, (completion, text) in enumerate(zip(completions, graded, strict=True)):
        ref = references[i // num_samples]
        verifier = verifiers[i // num_samples] if verifiers is not None else None
        strict = is_strict(text, ref, verifier)
        seq = tokens[i] if tokens is not None else completion.split()
        cut = bool(truncated[i]) if truncated is not None else False
        loop = tail_repeat(seq)
        length = int(lengths[i]) if lengths is not None else len(completion.split())
        record = {
            "prompt": i // num_samples,
            "sample": i % num_samples,
            "completion": completion,
            "reference": None if ref is None else str(ref),
            "answer": extract_answer(text),
            "length": length if model_tokens is None else int(model_tokens[i]),
            "truncated": cut,
            "strict": strict,
            "lenient": is_lenient(text, ref, verifier, strict),
            "formatted": is_formatted(text),
            "repeat": loop,
            "doom_loop": loop and cut,
        }
        if model_tokens is not None:
            record["tool_length"] = length - int(model_tokens[i])
        records.append(record)
    return records


def add_rewards(
    records: Sequence[dict[str, Any]], total: np.ndarray, per_fn: dict[str, np.ndarray]
) -> dict[str, float]:
    """Writes each record's ``reward`` (the weighted total) and ``rewards`` (per function, None
    where it could not score); returns ``reward_mean`` and each ``reward/<fn>/mean`` and
    ``reward/<fn>/failed_frac``, the names training logs."""

    def value(x) -> float | None:
        return None if not np.isfinite(x) else float(x)

    for i, record in enumerate(records):
        record["reward"] = value(total[i])
        record["rewards"] = {name: value(v[i]) for name, v in per_fn.items()}
    out = {"reward_mean": float(np.mean(np.nan_to_num(np.asarray(total, np.float64))))}
    for name, values in per_fn.items():
        values = np.asarray(values, np.float64)
        finite = values[np.isfinite(values)]
        out[f"reward/{name}/mean"] = float(finite.mean()) if finite.size else float("nan")
        out[f"reward/{name}/failed_frac"] = float(np.isnan(values).mean())
    return out


def summarize(records: Sequence[dict[str, Any]], num_samples: int) -> dict[str, Any]:
    """Every figure of one evaluation from its per-sample records.

    Returns:
      ``strict_accuracy`` / ``lenient_accuracy`` / ``format_rate`` / judge (if judged) rates,
      ``pass@k`` (strict) for every k <= G,
      ``lenient_pass@G``, ``mean@G``, truncation / repeat / doom-loop rates, and
      ``length`` / ``length_correct`` / ``length_incorrect`` stats (the model's ids), and
      ``tool_length`` stats where the records have them (runs with tools).
    """
    g = num_samples
    col = lambda key: np.asarray([r[key] for r in records], bool)  # noqa: E731
    strict, lenient = col("strict"), col("lenient")
    lengths = np.asarray([r["length"] for r in records], np.float64)
    out: dict[str, Any] = {
        "num_prompts": len(records) // g,
        "num_samples": g,
        STRICT: float(strict.mean()),
        LENIENT: float(lenient.mean()),
        FORMAT: float(col("formatted").mean()),
        "truncated": float(col("truncated").mean()),
        "repeat": float(col("repeat").mean()),
        "doom_loop": float(col("doom_loop").mean()),
        f"mean@{g}": float(strict.mean()),
    }
    if records and "judge" in records[0]:
        out["judge"] = float(col("judge").mean())
    for k, v in pass_at_all_k(strict.reshape(-1, g)).items():
        out[f"pass@{k}"] = v
    out[f"lenient_pass@{g}"] = pass_at_all_k(lenient.reshape(-1, g))[g]
    out["length"] = length_stats(lengths)
    out["length_correct"] = length_stats(lengths[strict])
    out["length_incorrect"] = length_stats(lengths[~strict])
    if records and "tool_length" in records[0]:
        out["tool_length"] = length_stats(np.asarray([r["tool_length"] for r in records]))
    return out


def default_columns(runs: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, str, str]]:
    """The seed study's layout: strict, lenient and pass@G (and the judge's rate when judged)
    for the first task, then strict for each other task.

    Args:
      runs: ``{run label: {task name: summary}}``.

    Returns:
      ``[(task, figure key, column header)]``.
    """
    tasks: list[str] = []
    for per_task in runs.values():
        tasks += [t for t in per_task if t not in tasks]
    columns = []
    for i, task in enumerate(tasks):
        label = {"gsm8k": "GSM8K", "jeebench": "JEE"}.get(task, task)
        if i == 0:
            g = next(r[task]["num_samples"] for r in runs.values() if task in r)
            columns += [(task, STRICT, f"{label} strict"), (task, LENIENT, f"{label} lenient")]
            columns.append((task, f"pass@{g}", f"{label} pass@{g}"))
            if any("judge" in r.get(task, {}) for r in runs.values()):
                columns.append((task, "judge", f"{label} judge"))
        else:
            columns.append((task, STRICT, label))
    return columns


def markdown_table(
    runs: dict[str, dict[str, dict[str, Any]]],
    columns: Sequence[tuple[str, str, str]] | None = None,
) -> str:
    """Runs side by side: one row per run, accuracies in percent with one decimal.

    Args:
      runs: ``{run label: {task name: summary from summarize()}}``, rows in dict order.
      columns: ``[(task, figure key, header)]``; default ``default_columns(runs)``.

    Returns:
      A GitHub Markdown table; a missing figure prints as ``-``.
    """
    columns = list(columns) if columns is not None else default_columns(runs)
    lines = [
        "| " + " | ".join(["strategy"] + [c[2] for c in columns]) + " |",
        "|" + "---|" + "---:|" * len(columns),
    ]
    for label, per_task in runs.items():
        cells = []
        for task, key, _ in columns:
            value = per_task.get(task, {}).get(key)
            cells.append("-" if value is None else f"{100.0 * value:.1f}")
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines) + "\n"


def results_table(results: dict[str, dict[str, Any]]) -> str:
    """``markdown_table`` of ``jaxgrpo.evaluate`` results ``{label: {"tasks": {task:
    {"summary": ...}}}}``."""
    summaries = {
        label: {task: v["summary"] for task, v in entry["tasks"].items()}
        for label, entry in results.items()
    }
    return markdown_table(summaries)
