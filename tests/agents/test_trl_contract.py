"""TRL 1.16's ``GRPOTrainer`` tool and environment contract, written as a TRL user writes the
code: ``reset(**row)`` gets the example's whole row, ``async def`` tools and ``get_reward`` are
awaited (a turn's calls together), a dict ``environment_factory`` routes each example by its
``environment`` column, a template that renders tools describes them and writes their results,
and arguments and results pass as TRL passes them."""

from __future__ import annotations

import asyncio
import copy
import importlib.resources
import threading
import time

import pytest

from jaxgrpo.agents import Agent, Toolbox, ToolCall, ToolResult, calc
from jaxgrpo.agents.tools import environment_reward
from jaxgrpo.core.errors import ConfigError, UserError
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.models.tokenizer import Tokenizer
from jaxgrpo.rl.run_log import run_header
from jaxgrpo.settings.loading import load_config

EXAMPLES = [
    {"messages": [{"role": "user", "content": "What is 3*4?"}], "answer": "12"},
    {"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"},
]
LLAMA_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def template_tokenizer(name: str, extra_tokens=()) -> Tokenizer:
    """The tiny vocabulary under one of the chat templates TRL ships (Qwen2.5's, Llama 3.1's)."""
    files = importlib.resources.files(pytest.importorskip("trl")) / "chat_templates"
    hf = copy.deepcopy(tiny_tokenizer().hf)
    if extra_tokens:
        hf.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
    hf.chat_template = (files / f"{name}.jinja").read_text()
    return Tokenizer(hf)


class MathEnv:
    """TRL's docs' shape: reset(**kwargs) reads the row, a tool, get_reward."""

    def reset(self, **kwargs):
        self.row = kwargs
        self.submitted = None

    def submit(self, answer: str) -> str:
        """Submits the final answer.

        Args:
            answer: The answer.
        """
        self.submitted = answer
        return "submitted"

    def get_reward(self) -> float:
        return float(self.submitted == self.row["answer"])


class PromptEnv:
    def reset(self, prompt, **kwargs):
        self.prompt, self.kwargs = prompt, kwargs
        return f" (answer in {len(prompt)} message)"


class GameEnv:
    async def reset(self, **kwargs):
        self.moves = []

    async def move(self, where: str) -> str:
        """Plays a move.

        Args:
            where: The square.
        """
        await asyncio.sleep(0.01)
        self.moves.append(where)
        return f"played {where}"

    async def get_reward(self) -> float:
        await asyncio.sleep(0.01)
        return float(len(self.moves))


async def fetch(url: str) -> str:
    """Fetches a page.

    Args:
        url: The page.
    """
    await asyncio.sleep(0.5)
    return f"page {url}"


async def hang(url: str) -> str:
    """Never answers.

    Args:
        url: The page.
    """
    await asyncio.Event().wait()
    return url


# reset(**row)


def test_reset_gets_the_whole_row_with_the_chat_as_prompt(tok):
    agent = Agent([], PromptEnv, tok)
    chats, boxes = agent.start(EXAMPLES, 2)
    env = boxes[2].environment
    assert env.prompt == EXAMPLES[1]["messages"] and env.kwargs == {"answer": "5"}
    assert chats[1][-1]["content"] == "What is 2+3? (answer in 1 message)"
    agent = Agent([], MathEnv, tok)
    _, boxes = agent.start(EXAMPLES, 1)
    assert boxes[0].environment.row == {"prompt": EXAMPLES[0]["messages"], "answer": "12"}


# async def tools and get_reward


def test_an_async_tool_is_awaited(tok):
    assert Toolbox([fetch]).call("fetch", {"url": "a"}, 5.0) == ToolResult("page a")


def test_a_turns_async_calls_run_together():
    calls = [ToolCall("fetch", {"url": u}, "") for u in "ab"]
    t0 = time.perf_counter()
    results = Toolbox([fetch, calc]).run_all(calls, 5.0)
    assert time.perf_counter() - t0 < 0.9
    assert [r.text for r in results] == ["page a", "page b"]


def test_an_async_tool_that_never_returns_times_out_off_the_main_thread():
    results = []
    worker = threading.Thread(
        target=lambda: results.append(Toolbox([hang]).call("hang", {"url": "a"}, 0.3))
    )
    t0 = time.perf_counter()
    worker.start()
    worker.join(5.0)
    assert time.perf_counter() - t0 < 2.0
    assert results == [ToolResult("{'error': 'Tool hang timed out after 0.3 s.'}", "timeout")]


def test_async_reset_methods_and_get_reward_are_awaited(tok):
    agent = Agent([], GameEnv, tok)
    _, boxes = agent.start(EXAMPLES[:1], 2)
    assert boxes[0].call("move", {"where": "e4"}, 5.0) == ToolResult("played e4")
    (reward,) = agent.reward_functions()
    assert reward(environments=[b.environment for b in boxes]) == [1.0, 0.0]
    assert environment_reward(boxes[0].environment) == 1.0


# several environments


def test_a_dict_of_factories_routes_each_example_by_its_environment_column(tok):
    agent = Agent([calc], {"math": MathEnv, "game": GameEnv}, tok)
    examples = [EXAMPLES[0] | {"environment": "math"}, EXAMPLES[1] | {"environment": "game"}]
    _, boxes = agent.start(examples, 2)
    assert [type(b.environment) for b in boxes] == [MathEnv, MathEnv, GameEnv, GameEnv]
    assert boxes[0].names == ("calc", "submit") and boxes[2].names == ("calc", "move")
    assert "environment" not in boxes[0].environment.row, "the routing column is not forwarded"
    boxes[0].call("submit", {"answer": "12"}, 1.0)
    boxes[2].call("move", {"where": "e4"}, 1.0)
    math, game = agent.reward_functions()
    envs = [b.environment for b in boxes]
    assert (math.__name__, game.__name__) == ("MathEnv", "GameEnv")
    assert math(environments=envs) == [1.0, 0.0, None, None]
    assert game(environments=envs) == [None, None, 1.0, 0.0]


def test_an_example_naming_no_environment_is_one_clear_error(tok):
    agent = Agent([], {"math": MathEnv}, tok)
    with pytest.raises(UserError, match=r"example 1 has environment='chess'.*\['math'\]"):
        agent.start(
            [EXAMPLES[0] | {"environment": "math"}, EXAMPLES[1] | {"environment": "chess"}], 1
        )


def test_the_config_names_several_environments(tok):
    envs = {"math": "test_trl_contract.MathEnv", "game": "test_trl_contract.GameEnv"}
    cfg = load_config("tiny.py", {"agent.environments": envs})
    agent = Agent.from_config(cfg.agent, tok)
    assert cfg.agent.enabled and set(agent.environment_types) == {"math", "game"}
    bad = {"math": "test_trl_contract.MathEnv", "game": "no_such_module.Game"}
    with pytest.raises(ConfigError, match=r"agent.environments.game.*no_such_module"):
        Agent.from_config(load_config("tiny.py", {"agent.environments": bad}).agent, tok)
    both = {"agent.environments": envs, "agent.environment": "test_trl_contract.MathEnv"}
    with pytest.raises(ConfigError, match="not both"):
        load_config("tiny.py", both)


# the chat template describes the tools


def test_a_template_that_renders_tools_renders_the_prompt_as_transformers_does():
    tok = template_tokenizer("qwen2_5")
    agent = Agent([calc], MathEnv, tok)
    chats, _ = agent.start(EXAMPLES[:1], 1)
    ids, mask = tok.encode_chat(chats, tools=agent.prompt_tools(EXAMPLES[:1]))
    ours = tok.hf.decode(ids[0][mask[0] > 0])
    expected = tok.hf.apply_chat_template(
        EXAMPLES[0]["messages"],
        tools=[calc, MathEnv().submit],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert ours == expected and "<tools>" in ours
    assert agent.template_tools and "rendered by the chat template" in agent.tools_line


@pytest.mark.parametrize(
    ("template", "extra", "ends"),
    [
        ("qwen2_5", (), "<|im_end|>"),
        ("qwen3", (), "<|im_end|>"),
        ("llama3_1", LLAMA_TOKENS, "<|eot_id|>"),
    ],
)
def test_results_are_the_templates_own_tool_messages(template, extra, ends):
    """What TRL's tool loop appends: the conversation rendered with the ``tool`` messages and
    the generation prompt, after the calling turn's end (which the model sampled)."""
    tok = template_tokenizer(template, extra)
    agent = Agent([calc], None, tok)
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "3*4"}}}
    turn = [*EXAMPLES[0]["messages"], {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = tok.hf.apply_chat_template(turn, tokenize=False)
    answer = [{"role": "tool", "name": "calc", "content": "12"}]
    after = tok.hf.apply_chat_template(turn + answer, add_generation_prompt=True, tokenize=False)
    head = before[: before.rindex(ends) + len(ends)]
    if template == "qwen3":  # renders the calling turn differently once answered
        head = after[: after.index(ends, after.index("<tool_call>")) + len(ends)]
    assert after == head + agent.format.render_results([("calc", "12")])


def test_a_template_without_tools_keeps_the_system_message_fallback(smollm2_gguf):
    tok = Tokenizer.from_gguf(smollm2_gguf)
    agent = Agent([calc], None, tok)
    chats, _ = agent.start(EXAMPLES[:1], 1)
    assert not agent.template_tools and agent.prompt_tools(EXAMPLES[:1]) is None
    assert chats[0][0]["role"] == "system" and "<tools>" in chats[0][0]["content"]
    assert agent.format.render_result("calc", "12").startswith("\n<|im_start|>user\n<tool_resp")
    line = "described in the system message (the chat template does not render tools)"
    assert agent.tools_line.endswith(line)


def test_the_run_header_says_how_the_tools_are_described():
    info = {
        "model": "tiny", "params": 1000, "trainable": 10, "lora_rank": 4, "task": "t",
        "train_size": 1, "eval_size": 1, "prompts_per_step": 1, "group_size": 2, "steps": 1,
        "devices": 1, "platform": "cpu", "mesh": {"data": 1}, "run_dir": "r", "start": 0,
        "cache_dir": None, "tools": "calc; json calls; rendered by the chat template",
    }  # fmt: skip
    assert "tools    calc; json calls; rendered by the chat template" in run_header(info)
