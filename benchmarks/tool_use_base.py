"""The embedded model with a calculator, untrained: how often it calls the tool, how often it is
right, and what a turn costs (a benchmark, not a test).

SmolLM2-135M-Instruct on the `arithmetic` task's held-out problems, G samples each, through
`jaxgrpo.agents.run_episodes` with the tag format (`<calc>expression</calc>` answered by
`<result>value</result>` in the same turn): the system message lists the tool, and one worked
example (a previous user/assistant exchange) shows a call and its result. The same prompts
without the tool (no system message about it, the example answered in words) are the
single-turn baseline. Prints strict accuracy, the share of episodes with a call, turns, tool
errors by kind, and seconds per turn (the first turn samples from the prompts; a later one
prefills each calling row's whole context, then decodes).

With ``--passes 2`` the second pass runs with every program compiled, and each later turn is
timed again with a budget of one token: the prefill of the rows' whole context alone, which is
what reusing the KV cache across turns could save (all but the appended tokens' share).

    python benchmarks/tool_use_base.py [--problems 32] [--samples 4] [--new-tokens 128] \
        [--passes 2] [--arms calculator]
"""

from __future__ import annotations

import argparse
import functools
import time

from jaxgrpo.core.host import prepare_cli

prepare_cli()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxgrpo.agents import (  # noqa: E402
    AgentLimits,
    Toolbox,
    calc,
    get_format,
    metrics,
    model_sampler,
    run_episodes,
)
from jaxgrpo.data import get_task  # noqa: E402
from jaxgrpo.grading.accuracy import strict_correct  # noqa: E402
from jaxgrpo.models import load_model  # noqa: E402
from jaxgrpo.run.build import smollm2_path  # noqa: E402
from jaxgrpo.sampling import SamplerSettings, generate  # noqa: E402

EXAMPLE_QUESTION = (
    "Mia has 4 bags with 3 pens in each bag. Then Mia gets 5 more pens. How many pens does Mia "
    "have now?"
)
EXAMPLE_WITH_TOOL = (
    "Mia has 4 bags of 3 pens and gets 5 more: <calc>4*3+5</calc><result>17</result> "
    "Mia has 17 pens now. <answer>17</answer>"
)
EXAMPLE_IN_WORDS = (
    "Mia has 4 bags of 3 pens, so 4 * 3 = 12 pens. Getting 5 more gives 12 + 5 = 17. "
    "<answer>17</answer>"
)


def prompts(task, n: int, system: str | None, example_answer: str) -> tuple[list, list]:
    """The first ``n`` held-out problems as chats with the worked example before them."""
    examples = task.eval_examples()[:n]
    chats = []
    for ex in examples:
        question = ex["messages"][-1]
        head = [{"role": "system", "content": system}] if system else []
        head += [
            {"role": "user", "content": EXAMPLE_QUESTION},
            {"role": "assistant", "content": example_answer},
        ]
        chats.append(head + [question])
    return chats, examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="G per problem")
    parser.add_argument("--new-tokens", type=int, default=128, help="the episode's budget")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument(
        "--passes", type=int, default=1, help="run each arm this many times; the last is timed "
        "warm (every program compiled) and also times each later turn's prefill alone",
    )  # fmt: skip
    parser.add_argument("--arms", default="no tool,calculator", help="comma-separated arms")
    args = parser.parse_args()

    model, tok = load_model(smollm2_path())
    task = get_task("arithmetic", num_eval=args.problems)
    toolbox = Toolbox([calc])
    fmt = get_format("tag", toolbox.schemas)
    settings = SamplerSettings.for_tokenizer(
        tok, max_new_tokens=args.new_tokens, temperature=args.temperature
    )
    g = args.samples
    rows, shapes = [], []
    arms = [
        ("no tool", None, EXAMPLE_IN_WORDS),
        ("calculator", fmt.system_prompt(toolbox.schemas), EXAMPLE_WITH_TOOL),
    ]
    for arm, system, answer in [a for a in arms if a[0] in args.arms.split(",")]:
        for last in [False] * (args.passes - 1) + [True]:
            chats, examples = prompts(task, args.problems, system, answer)
            ids, mask = tok.encode_chat(chats)
            seconds: dict[int, float] = {}
            sample = model_sampler(functools.partial(generate, model), settings, jax.random.key(0))

            def timed(ids, mask, num_samples, max_lengths, turn, _seconds=seconds, _sample=sample,
                      _last=last, _arm=arm):  # fmt: skip
                start = time.perf_counter()
                out = _sample(ids, mask, num_samples, max_lengths, turn)
                out.tokens.block_until_ready()
                _seconds[turn] = _seconds.get(turn, 0.0) + time.perf_counter() - start
                if _last and turn > 0:  # the same context, one token each: its prefill's cost
                    start = time.perf_counter()
                    ones = np.ones(ids.shape[0], np.int32)
                    _sample(ids, mask, num_samples, ones, turn).tokens.block_until_ready()
                    prefill = time.perf_counter() - start
                    decoded = int(np.asarray(out.lengths).sum())
                    shapes.append((_arm, turn, ids.shape, decoded, _seconds[turn], prefill))
                return out

            n_rows = len(examples) * g
            start = time.perf_counter()
            batch = run_episodes(
                timed,
                tok,
                fmt,
                [Toolbox([calc]) for _ in range(n_rows)],
                ids,
                mask,
                group=g,
                max_new_tokens=args.new_tokens,
                limits=AgentLimits(max_turns=4, max_tool_tokens=32, tool_timeout_s=5.0),
            )
            wall = time.perf_counter() - start
            texts = [
                tok.hf.decode(t[m != 0].tolist())
                for t, m in zip(batch.tokens, batch.mask, strict=True)
            ]
            columns = {"answer": [ex["answer"] for ex in examples for _ in range(g)]}
            strict = strict_correct("arithmetic", texts, columns)
            m = metrics(batch.episodes)
            called = np.mean([e.tool_calls > 0 for e in batch.episodes])
            failures = {
                k.split("/")[-1]: v for k, v in m.items() if k.startswith("agent/failed/") and v
            }
            rows.append(
                (
                    arm,
                    strict.mean(),
                    called,
                    m["agent/turns"],
                    m["agent/failed"],
                    failures,
                    seconds,
                    wall,
                )
            )
            if not last:
                rows.pop()
                continue
            print(f"{arm}: example episode:\n{texts[0]}\n", flush=True)

    print(f"SmolLM2-135M-Instruct, arithmetic held-out, {args.problems} problems x {g} samples, "
          f"{args.new_tokens}-token episodes, temperature {args.temperature}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")  # fmt: skip
    print("| arm | strict % | episodes with a call % | turns | tool errors per episode | "
          "errors by kind | s per turn (turn: s) | wall s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---|---:|")
    for arm, strict, called, turns, failed, kinds, seconds, wall in rows:
        per_turn = ", ".join(f"{t}: {s:.1f}" for t, s in sorted(seconds.items()))
        print(
            f"| {arm} | {100 * strict:.1f} | {100 * called:.1f} | {turns:.2f} | {failed:.2f} | "
            f"{kinds or '-'} | {per_turn} | {wall:.0f} |"
        )
    if shapes:
        print("\nlater turns (the last pass): each re-prefills its rows' whole context")
        print("| arm | turn | rows x context tokens | tokens decoded | turn s | prefill alone s |")
        print("|---|---:|---|---:|---:|---:|")
        for arm, turn, (n, width), decoded, total, prefill in shapes:
            print(f"| {arm} | {turn} | {n} x {width} | {decoded} | {total:.2f} | {prefill:.2f} |")


if __name__ == "__main__":
    main()
