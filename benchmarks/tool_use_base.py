"""The embedded model with a calculator, untrained: how often it calls the tool, how often it is
right, and what a later turn costs from the kept KV cache against sampling the whole context
afresh (a benchmark, not a test).

SmolLM2-135M-Instruct on the `arithmetic` task's held-out problems, G samples each, through
`jaxgrpo.agents.run_episodes` with the tag format (`<calc>expression</calc>` answered by
`<result>value</result>` in the same turn): the system message lists the tool, and one worked
example (a previous user/assistant exchange) shows a call and its result. The same prompts
without the tool (no system message about it, the example answered in words) are the
single-turn baseline. Prints strict accuracy, the share of episodes with a call, turns, tool
errors by kind, and seconds per turn.

The calculator arm runs its later turns two ways through the same mesh sampler and keys:
``cache`` (the trainer's: each row continued from its KV cache, only the appended ids
prefilled) and ``whole`` (each calling row's whole context prefilled again as a new prompt).
With ``--passes 2`` the second pass is timed with every program compiled.

    python benchmarks/tool_use_base.py [--problems 32] [--samples 4] [--new-tokens 128] \
        [--passes 2] [--arms calculator] [--later cache,whole]
"""

from __future__ import annotations

import argparse
import time
import types

from jaxgrpo.core.host import prepare_cli

prepare_cli()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxgrpo.agents import AgentLimits, Toolbox, calc, get_format, metrics, run_episodes  # noqa: E402
from jaxgrpo.core.sharding import make_mesh  # noqa: E402
from jaxgrpo.data import get_task  # noqa: E402
from jaxgrpo.eval.completions import mesh_sampler  # noqa: E402
from jaxgrpo.grading.accuracy import strict_correct  # noqa: E402
from jaxgrpo.models import load_model  # noqa: E402
from jaxgrpo.models.aliases import smollm2_path  # noqa: E402
from jaxgrpo.sampling import SamplerSettings  # noqa: E402

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
        "warm (every program compiled)",
    )  # fmt: skip
    parser.add_argument("--arms", default="no tool,calculator", help="comma-separated arms")
    parser.add_argument(
        "--later", default="cache,whole", help="how the calculator arm samples later turns"
    )
    args = parser.parse_args()

    model, tok = load_model(smollm2_path())
    task = get_task("arithmetic", num_eval=args.problems)
    toolbox = Toolbox([calc])
    fmt = get_format("tag", toolbox.schemas)
    settings = SamplerSettings.for_tokenizer(
        tok, max_new_tokens=args.new_tokens, temperature=args.temperature
    )
    g = args.samples
    rows = []
    arms = [
        ("no tool", None, EXAMPLE_IN_WORDS),
        ("calculator", fmt.system_prompt(toolbox.schemas), EXAMPLE_WITH_TOOL),
    ]
    graphdef, state = nnx.split(model)
    mesh = make_mesh({"data": 1}, jax.devices()[:1])

    def sampler(keep: bool):
        sample = mesh_sampler(
            graphdef, (state,), model.cfg, mesh, settings, jax.random.key(0), keep_cache=keep
        )
        if keep:
            return sample
        return lambda ids, mask, g, lengths, turn, resume: sample(ids, mask, g, lengths, turn)

    runs = [(arm, later) for arm in args.arms.split(",") for later in args.later.split(",")]
    runs = [(arm, later) for arm, later in runs if arm == "calculator" or later == "whole"]
    for arm, later in runs:
        system, answer = {a: (s, e) for a, s, e in arms}[arm]
        for last in [False] * (args.passes - 1) + [True]:
            chats, examples = prompts(task, args.problems, system, answer)
            ids, mask = tok.encode_chat(chats)
            seconds: dict[int, float] = {}
            sample = sampler(later == "cache")

            def timed(*call, _seconds=seconds, _sample=sample):
                start = time.perf_counter()
                out = types.SimpleNamespace(**_sample(*call))
                turn = call[4]
                _seconds[turn] = _seconds.get(turn, 0.0) + time.perf_counter() - start
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
            label = arm if arm == "no tool" else f"{arm}, later turns: {later}"
            rows.append(
                (
                    label,
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


if __name__ == "__main__":
    main()
