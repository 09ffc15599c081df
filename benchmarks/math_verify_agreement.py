"""Agreement of jaxgrpo's answer checks with math-verify's own regression labels.

    python benchmarks/math_verify_agreement.py [--cases benchmarks/math_verify_cases.jsonl]

Each case of ``math_verify_cases.jsonl`` (gold, pred, expected label and the test group, as
math-verify's ``tests/test_all.py`` states them) is presented the way a policy would answer,
``<answer>pred</answer>``, with ``gold`` as the task's reference, and scored three ways:

- ``fast path``: ``exact_answer`` without a verifier column (GSM8K tasks, and every task before
  math-verify);
- ``math_verify column``: ``exact_answer`` with ``verifier = MATH_VERIFY`` (the math and
  jeebench tasks);
- ``math-verify alone``: math-verify's own parse + verify on the whole presented completion,
  with the configuration of its test helper (LaTeX and expression targets).

A case may carry ``"precision": N`` (the suite asserts it with ``float_rounding=N``; without it
the suite's default, 6) and ``"set_relation": true`` (asserted with
``allow_set_relation_comp=True``). The math-verify-alone scorer applies both, as the suite does.
The two jaxgrpo scorers do not: a reward has one fixed configuration, so they score every case
as training would, math-verify at its default ``float_rounding`` of 6 and without set-relation
comparison. Their agreement on those cases measures what training rewards, not the suite's
looser setting.

Printed: agreement with the labels per group and overall (percent, then as a fraction of
cases), and the wrong answers each accepted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from jaxgrpo.grading.verify import MATH_VERIFY
from jaxgrpo.rewards.math import exact_answer

DEFAULT_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_verify_cases.jsonl")


def read_cases(path: str) -> list[dict]:
    """The cases of a JSONL file: ``{"group", "gold", "pred", "expected"}`` per line, with an
    optional ``"precision"`` and ``"set_relation"``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def math_verify_alone(
    gold: str, completion: str, precision: int = 6, set_relation: bool = False
) -> bool:
    """math-verify on the whole completion, configured as its test suite's ``compare_strings``:
    ``precision`` is its ``float_rounding``, ``set_relation`` its ``allow_set_relation_comp``."""
    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return bool(
        verify(
            parse(gold, targets),
            parse(completion, targets),
            float_rounding=precision,
            allow_set_relation_comp=set_relation,
        )
    )


def score(cases: list[dict]) -> dict[str, list[bool]]:
    """Scorer name -> per-case verdicts (True = judged equal)."""
    completions = [f"<answer>{c['pred']}</answer>" for c in cases]
    golds = [c["gold"] for c in cases]
    prompts = [""] * len(cases)
    fast = exact_answer(prompts, completions, answer=golds)
    verified = exact_answer(prompts, completions, answer=golds, verifier=[MATH_VERIFY] * len(cases))
    return {
        "fast path": [s == 1.0 for s in fast],
        "math_verify column": [s == 1.0 for s in verified],
        "math-verify alone": [
            math_verify_alone(g, c, case.get("precision", 6), case.get("set_relation", False))
            for g, c, case in zip(golds, completions, cases, strict=True)
        ],
    }


def agreement(cases: list[dict], verdicts: list[bool]) -> float:
    """The fraction of cases whose verdict equals the expected label."""
    hits = sum(v == bool(c["expected"]) for c, v in zip(cases, verdicts, strict=True))
    return hits / len(cases)


def report(cases: list[dict], verdicts: dict[str, list[bool]]) -> str:
    """Agreement table (percent of cases whose verdict equals the label) and false accepts."""
    groups = collections.defaultdict(list)
    for i, case in enumerate(cases):
        groups[case["group"]].append(i)
    names = list(verdicts)
    lines = ["| group | cases | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]

    def agree(name, rows):
        hits = sum(verdicts[name][i] == bool(cases[i]["expected"]) for i in rows)
        return f"{100.0 * hits / len(rows):.0f}%"

    for group, rows in groups.items():
        cells = " | ".join(agree(n, rows) for n in names)
        lines.append(f"| {group} | {len(rows)} | {cells} |")
    everything = list(range(len(cases)))
    total = " | ".join(agree(n, everything) for n in names)
    lines.append(f"| **all** | {len(cases)} | {total} |")

    def hits(name):
        return sum(verdicts[name][i] == bool(cases[i]["expected"]) for i in everything)

    fractions = (f"{n} {hits(n)}/{len(cases)} = {agreement(cases, verdicts[n]):.3f}" for n in names)
    lines.append("\nagreement: " + ", ".join(fractions))
    for name in names:
        wrong = [i for i in everything if verdicts[name][i] and not cases[i]["expected"]]
        lines.append(f"\n{name}: {len(wrong)} wrong answers accepted")
        lines += [f"  gold {cases[i]['gold']!r} pred {cases[i]['pred'][:80]!r}" for i in wrong]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="JSONL of gold/pred/expected")
    args = parser.parse_args(argv)
    cases = read_cases(args.cases)
    print(report(cases, score(cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
