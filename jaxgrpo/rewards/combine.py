"""Combining rewards: ``RewardSet``, with curricula (``curriculum``, weights over steps).

``RewardSet`` is what the learner calls once per step: it runs every reward function on the
batch's completions (``async def`` ones awaited together, ``calls``), turns ``None`` into NaN,
and returns the weighted total with the weights of that step, so "soft first, then hard" is one
config line::

    RewardSet([("embedding", {"kind": "linear", "start": 1.0, "end": 0.0, "end_step": 500}),
               ("exact_answer", {"kind": "step", "start": 0.0, "end": 1.0, "end_step": 500})])
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxgrpo.core.errors import UserError
from jaxgrpo.rewards import calls
from jaxgrpo.rewards.curriculum import CURRICULUM_KINDS, Curriculum
from jaxgrpo.rewards.inputs import RewardInputs
from jaxgrpo.rewards.limits import RewardLimitExceeded, bounded_call
from jaxgrpo.rewards.registry import get_reward, reward_name

RewardFn = Callable[..., list]
_LOG = logging.getLogger(__name__)
TIMEOUT_S = 300.0  # rewards.timeout_s's default: one call of one function, for the whole batch
MAX_MEMORY_GB = 8.0  # rewards.max_memory_gb's default: growth of the process during one call
CONVERSATIONAL = (True, False, "auto")  # rewards.conversational's values
__all__ = ["CURRICULUM_KINDS", "Curriculum", "RewardError", "RewardSet", "TrainerState"]


class RewardError(UserError, ValueError):
    """A reward function cannot score a run: it fails every sample, step after step, or
    returns the wrong number of values. The message names the function and a failing sample."""


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """The fields of ``transformers.TrainerState`` that reward functions read, passed as
    ``trainer_state`` as TRL's GRPOTrainer does (e.g. to shape a reward over training).

    Attributes:
      global_step: the step whose completions are being scored (0 at the first step; TRL's
        count of optimizer steps done so far).
      max_steps: the run's ``steps`` (0 when unknown, e.g. outside training).
    """

    global_step: int = 0
    max_steps: int = 0


@dataclasses.dataclass
class _Term:
    name: str
    fn: RewardFn
    weight: Curriculum
    builtin: bool = False  # jaxgrpo's own: always gets strings, the model's text alone
    awaited: bool = False  # an async def function
    reported: bool = False
    failed_steps: int = 0  # consecutive training steps in which every sample failed
    counted_step: int | None = None  # the step failed_steps last looked at


def _is_builtin(fn: Callable) -> bool:
    """True for functions defined in the jaxgrpo package (they take strings and grade what the
    model wrote: ``model_completions``), unless they set ``trl_arguments = True`` to be called
    as a user's function is (a reward model reads TRL's prompts and completions)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if getattr(fn, "trl_arguments", False):
        return False
    return getattr(fn, "__module__", "").split(".")[0] == "jaxgrpo"


@dataclasses.dataclass(frozen=True)
class _Failure:
    """Why every sample of a call failed: sample ``index`` and ``why``; ``limit``: the call
    was stopped by a limit (its arguments were not the problem)."""

    index: int
    why: str
    limit: bool = False

    def describe(self, completions: Sequence) -> str:
        text = str(completions[self.index])[:300]
        return f"sample {self.index} {self.why}; completion {text!r}"


class RewardSet:
    """Weighted reward functions with per-step curricula and per-sample error isolation.

    ``None`` (cannot score) becomes NaN in the per-function columns and contributes nothing to
    the total, i.e. it counts as weight 0 for that sample (no renormalisation, so a sample's
    scale never depends on which other rewards could score it). A sample that no function could
    score has total NaN, which the advantage computation must exclude. How functions are
    called (TRL's keyword arguments) is in the ``jaxgrpo.rewards`` module docstring.

    Args:
      specs: ``(name_or_callable, weight)`` or ``(name_or_callable, weight, kwargs)`` where
        weight is a float, a ``Curriculum`` or a dict of its fields, and kwargs are bound to the
        function (``get_reward(name, **kwargs)``).
      on_error: ``"none"``: a sample whose reward raises scores None; the first failure of each
        function is logged once (a warning naming the function and the offending sample) and
        ``error_counts[name]`` counts all of them for the metrics; ``"raise"``: raise
        ``RewardError``, naming the function.
      conversational: whether ``score`` gives user functions TRL's conversational prompts and
        completions (lists of messages) rather than strings: True, False, or ``"auto"``: where
        the data's rows are chats (``RewardInputs.conversational``, TRL's rule).
      timeout_s / max_memory_gb: limits on each call of each function (``limits.bounded_call``,
        from any thread; 0 = none). A call past one scores all its samples None (failed) and is
        logged once per function; it never stops the run by itself (``max_failed_steps`` still
        applies).
        ``async def`` functions run together, each with ``timeout_s`` (``calls``).

    Attributes:
      lock: held by whoever scores and then reads ``logged_*`` (asynchronous rollouts score
        training batches on a thread of their own while the main thread evaluates).
      logged_metrics / logged_extra: what functions passed to TRL's ``log_metric(name, value)``
        and ``log_extra(column, values)`` during the latest step scored.
    """

    def __init__(
        self,
        specs: Sequence[Sequence[Any]],
        on_error: str = "none",
        *,
        conversational: bool | str = "auto",
        timeout_s: float = TIMEOUT_S,
        max_memory_gb: float = MAX_MEMORY_GB,
    ):
        if on_error not in ("none", "raise"):
            raise ValueError(f"on_error must be 'none' or 'raise', got {on_error!r}")
        if not (isinstance(conversational, bool) or conversational == "auto"):
            raise ValueError(
                f"conversational must be True, False or 'auto', got {conversational!r}"
            )
        self.on_error = on_error
        self.conversational = conversational
        self.timeout_s = timeout_s
        self.max_memory_gb = max_memory_gb
        self.terms: list[_Term] = []
        self.error_counts: dict[str, int] = {}
        self.logged_metrics: dict[str, list[float]] = {}
        self.logged_extra: dict[str, list] = {}
        self._logged_step: int | None = None
        self.lock = threading.RLock()
        for spec in specs:
            if len(spec) not in (2, 3):
                raise ValueError(f"reward spec must be (name, weight[, kwargs]), got {spec!r}")
            target, weight = spec[0], spec[1]
            kwargs = spec[2] if len(spec) == 3 else {}
            name = reward_name(target)
            if name in {t.name for t in self.terms}:
                name = f"{name}#{len(self.terms)}"
            fn = get_reward(target, **kwargs)
            weight = Curriculum.from_spec(weight)
            self.terms.append(_Term(name, fn, weight, _is_builtin(fn), calls.is_async(fn)))

    def score(
        self, inputs: RewardInputs, *, max_failed_steps: int | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Scores ``inputs`` (``jaxgrpo.rewards.inputs``): what every caller uses, so reward
        functions get the same arguments in training and in evaluation.

        Args:
          inputs: the batch, its columns, step and run length.
          max_failed_steps: as in ``__call__`` (training passes ``rewards.max_failed_steps``).

        Returns:
          As ``__call__``.
        """
        chats = self.conversational is True or (
            self.conversational == "auto" and inputs.conversational
        )
        return self(
            inputs.prompts,
            inputs.completions,
            inputs.columns,
            inputs.step,
            prompt_messages=inputs.prompt_messages if chats else None,
            completion_messages=inputs.completion_messages,
            max_steps=inputs.max_steps,
            max_failed_steps=max_failed_steps,
        )

    def weights(self, step: int) -> dict[str, float]:
        """Each function's weight at ``step``."""
        return {t.name: t.weight(step) for t in self.terms}

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        columns: Mapping[str, Sequence[Any]] | None = None,
        step: int = 0,
        *,
        prompt_messages: Sequence[list[dict]] | None = None,
        completion_messages: Sequence[list[dict]] | None = None,
        max_steps: int = 0,
        max_failed_steps: int | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Scores a batch.

        Args:
          prompts: [N] prompt strings (as the model saw them).
          completions: [N] completion strings (whole episodes with tools).
          columns: per-sample keyword arguments, each a length-N sequence: the task's columns
            (e.g. ``answer``) and, in training, ``completion_ids``, ``completion_lengths`` and
            ``model_completions`` (what the model wrote; jaxgrpo's own functions get it as
            their ``completions``).
          step: the training step, for curricula.
          prompt_messages: [N] prompts as chat messages. Given: user functions get TRL's
            conversational ``prompts``/``completions`` (lists of messages); None: strings.
          completion_messages: [N] the completions as messages when they are episodes with
            tool calls (``RewardInputs.completion_messages``); None: one assistant message each.
          max_steps: the run's length, for ``trainer_state`` (``TrainerState(step, max_steps)``,
            passed to every function).
          max_failed_steps: in training, raise ``RewardError`` once a function has failed
            every sample (raised or returned None) of this many consecutive steps; None: never.

        Returns:
          ``(total [N] float32, per_fn {name: [N] float32 with NaN for None}, weights {name:
          float})``.
        """
        columns = dict(columns or {})
        n = len(completions)
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
        if self._logged_step != step:
            self.logged_metrics, self.logged_extra, self._logged_step = {}, {}, step
        context = {
            "trainer_state": TrainerState(global_step=step, max_steps=max_steps),
            "log_extra": self._log_extra,
            "log_metric": self._log_metric,
        }
        conversational = None
        if prompt_messages is not None:
            assistant = [[{"role": "assistant", "content": c}] for c in completions]
            if completion_messages is not None:
                assistant = [list(m) for m in completion_messages]
            conversational = (list(prompt_messages), assistant)
        graded = list(columns.get("model_completions", completions))

        def arguments(term: _Term) -> tuple:
            if term.builtin:
                return prompts, graded
            return conversational or (prompts, completions)

        scored = {
            t.name: self._score(t, *arguments(t), columns, context)
            for t in self.terms
            if not t.awaited
        }
        scored |= self._score_async(
            [t for t in self.terms if t.awaited], arguments, columns, context
        )
        per_fn = {}
        for term in self.terms:
            per_fn[term.name], failure = scored[term.name]
            if max_failed_steps is not None:
                c = arguments(term)[1]
                self._count_failed_step(term, step, failure, max_failed_steps, c, conversational)
        return self._total(per_fn, self.weights(step), n), per_fn, self.weights(step)

    @staticmethod
    def _total(per_fn: dict[str, np.ndarray], weights: dict[str, float], n: int) -> np.ndarray:
        """The weighted sum; NaN where no function scored; 0 everywhere for a set of no
        functions (a distillation run's only signal is its teacher's)."""
        scored = np.full((n,), not per_fn, np.bool_)
        total = np.zeros((n,), np.float32)
        for name, values in per_fn.items():
            ok = ~np.isnan(values)
            scored |= ok
            total += np.where(ok, np.float32(weights[name]) * values, np.float32(0.0))
        return np.where(scored, total, np.float32(np.nan)).astype(np.float32)

    def forget_logged(self) -> None:
        """Empties ``logged_*``: a step keeps what its scoring logs, not an evaluation's."""
        self.logged_metrics, self.logged_extra = {}, {}

    def _log_extra(self, column: str, values: list) -> None:
        self.logged_extra.setdefault(column, []).extend(values)

    def _log_metric(self, name: str, value: float) -> None:
        self.logged_metrics.setdefault(name, []).append(float(value))

    def _count_failed_step(self, term, step, failure, max_failed_steps, completions, conv):
        """Counts steps in which every sample failed; a step with one scored sample resets."""
        if failure is None:
            term.failed_steps, term.counted_step = 0, step
            return
        if term.counted_step != step:
            term.failed_steps, term.counted_step = term.failed_steps + 1, step
        if term.failed_steps < max_failed_steps:
            return
        hint = ""
        if not term.builtin and conv is None and not failure.limit:
            hint = (
                " (it got prompt/completion strings; a function written for TRL's "
                "conversational format needs rewards.conversational=True)"
            )
        raise RewardError(
            f"reward function {term.name!r} failed on every sample of {term.failed_steps} "
            f"consecutive steps (rewards.max_failed_steps={max_failed_steps}), e.g. "
            f"{failure.describe(completions)}{hint}"
        )

    def _score(self, term: _Term, prompts, completions, columns, context):
        """[N] float32 values (NaN = None), and a ``_Failure`` when every sample failed, else
        None."""
        on = self.on_error != "raise"
        try:
            values, errors = bounded_call(
                lambda: calls.call(term.fn, prompts, completions, columns, context, on),
                self.timeout_s,
                self.max_memory_gb,
            )
        except RewardLimitExceeded as stop:
            return self._limited(term, str(stop), len(completions))
        except Exception as error:  # only with on_error="raise"
            raise self._raised(term, error) from error
        return self._values(term, values, errors, completions)

    def _score_async(self, terms: Sequence[_Term], arguments, columns, context) -> dict:
        """``_score`` of every ``async def`` function, awaited together (``calls``)."""

        on = self.on_error != "raise"
        outcomes = calls.await_all(
            {t.name: calls.acall(t.fn, *arguments(t), columns, context, on) for t in terms},
            self.timeout_s,
            self.max_memory_gb,
        )
        scored = {}
        for term in terms:
            out, completions = outcomes[term.name], arguments(term)[1]
            if isinstance(out, RewardLimitExceeded):
                scored[term.name] = self._limited(term, str(out), len(completions))
            elif isinstance(out, Exception) and self.on_error == "raise":
                raise self._raised(term, out) from out
            elif isinstance(out, BaseException):  # cancelled: no values
                scored[term.name] = self._limited(term, f"stopped: {out!r}", len(completions))
            else:
                scored[term.name] = self._values(term, *out, completions)
        return scored

    @staticmethod
    def _raised(term: _Term, error: Exception) -> RewardError:
        return RewardError(f"reward function {term.name!r} raised: {error!r}")

    def _limited(self, term: _Term, why: str, n: int):
        """A call stopped by a limit: all its samples failed (or, on_error="raise", stop)."""
        if self.on_error == "raise":
            raise RewardError(f"reward function {term.name!r} {why}") from None
        self._report_limit(term, why, n)
        return np.full((n,), np.nan, np.float32), _Failure(0, why, limit=True)

    def _values(self, term: _Term, values, errors: dict, completions):
        """The checked values of a call, its samples' errors counted (``_score``'s return)."""
        n = len(completions)
        if errors:
            self._report_errors(term, errors, completions)
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise RewardError(f"reward function {term.name!r} returned {got} for {n} completions")
        out = np.array([np.nan if v is None else float(v) for v in values], np.float32)
        if n == 0 or not np.isnan(out).all():
            return out, None
        if errors:
            i = min(errors)
            return out, _Failure(i, f"raised {errors[i]!r}")
        return out, _Failure(0, "returned None")

    def _report_limit(self, term: _Term, why: str, n: int) -> None:
        """Counts a call stopped by a limit; the first of each function is logged."""
        self.error_counts[term.name] = self.error_counts.get(term.name, 0) + n
        if not term.reported:
            term.reported = True
            _LOG.warning(
                "reward function %r %s; its %d samples score None (further failures are only "
                "counted in error_counts)",
                term.name,
                why,
                n,
            )

    def _report_errors(self, term: _Term, failed: dict, completions) -> None:
        """Counts the samples that raised; the first failure of each function is logged."""
        self.error_counts[term.name] = self.error_counts.get(term.name, 0) + len(failed)
        if not term.reported:
            term.reported = True
            i = min(failed)
            _LOG.warning(
                "reward function %r raised on %d of %d samples; they score None (further "
                "failures are only counted in error_counts). Sample %d, error %r, completion %r",
                term.name,
                len(failed),
                len(completions),
                i,
                failed[i],
                str(completions[i])[:500],
            )
