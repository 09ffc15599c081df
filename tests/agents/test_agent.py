"""The ``agent`` config section and the ``Agent`` it builds: names resolved with one clear
error, the tools described in the system message, one environment per episode reset with its
example's columns, and the environment's reward as a reward function named after its class."""

import random

import pytest

from jaxgrpo.agents import Agent, calc
from jaxgrpo.core.errors import ConfigError, UserError
from jaxgrpo.models.tiny import tiny_tokenizer
from jaxgrpo.settings.loading import load_config


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class Counter:
    """An environment: its public method is a tool; reset and get_reward are not."""

    def reset(self, answer, **kwargs):
        self.count = 0
        return f" Reach {answer}."

    def step(self, by: int) -> int:
        """Adds to the count.

        Args:
            by: how much to add.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class Noisy(Counter):
    def reset(self, **kwargs):
        return f" Reach {random.random()}."


EXAMPLES = [
    {"messages": [{"role": "user", "content": "Count."}], "answer": "3"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]}
    | {"answer": "5"},
]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"agent.tools": ("calculator",)}, "agent.tools[0]"),
        ({"agent.environment": "Counter"}, "agent.environment"),
        ({"agent.format": "xml"}, "agent.format"),
        ({"agent.max_turns": 0}, "agent.max_turns"),
        ({"agent.max_tool_tokens": 0}, "agent.max_tool_tokens"),
        ({"agent.tool_timeout_s": 0.0}, "agent.tool_timeout_s"),
        ({"agent.environment_reward_weight": -1.0}, "agent.environment_reward_weight"),
        ({"agent.max_turn": 2}, "agent.max_turn"),
    ],
)
def test_bad_agent_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config("tiny.py", overrides)


def test_the_section_defaults_to_no_agent_and_accepts_builtin_tools():
    assert not load_config("tiny.py").agent.enabled
    cfg = load_config("tiny.py", {"agent.tools": ("calc", "python"), "agent.format": "tag"})
    assert cfg.agent.enabled and cfg.agent.tools == ("calc", "python")


def test_names_resolve_or_fail_naming_the_key(tok):
    agent = Agent.from_names(("calc",), "test_agent.Counter", tok, format="json")
    assert [s["function"]["name"] for s in agent.schemas] == ["calc", "step"]
    assert agent.environment is Counter and agent.environment_name == "Counter"
    with pytest.raises(ConfigError, match=r"agent.tools\[1\].*no_such_module"):
        Agent.from_names(("calc", "no_such_module.fn"), "", tok)
    with pytest.raises(ConfigError, match="agent.environment.*no attribute 'Nope'"):
        Agent.from_names((), "test_agent.Nope", tok)


def test_episodes_start_with_instructions_and_the_environments_text(tok):
    agent = Agent([calc], Counter, tok, format="json")
    chats, boxes = agent.start(EXAMPLES, 3)
    assert len(chats) == 2 and len(boxes) == 6
    assert chats[0][0]["role"] == "system" and "<tools>" in chats[0][0]["content"]
    assert chats[1][0]["content"].startswith("Be brief.\n\n# Tools")
    assert chats[0][-1]["content"] == "Count. Reach 3."
    envs = [box.environment for box in boxes]
    assert len({id(e) for e in envs}) == 6, "one environment per episode"
    assert boxes[0].call("step", {"by": 2}, 1.0).text == "2"
    assert (envs[0].count, envs[1].count) == (2, 0), "episodes do not share state"
    (reward,) = agent.reward_functions()
    assert reward.__name__ == "Counter" and reward(environments=envs) == [2.0] + [0.0] * 5


def test_one_group_needs_one_observation(tok):
    with pytest.raises(UserError, match="Noisy.reset returned different text"):
        Agent([], Noisy, tok).start(EXAMPLES[:1], 2)


def test_without_get_reward_or_at_weight_zero_there_is_no_environment_reward(tok):
    assert Agent([calc], None, tok).reward_functions() == []
    assert Agent([], Counter, tok, reward_weight=0.0).reward_functions() == []
