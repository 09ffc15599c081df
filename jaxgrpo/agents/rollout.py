"""Episodes of several turns: sample a turn for every row, run the calls it makes, append the
results' tokens, and sample again only the rows that called a tool, until a turn without a
call, ``AgentLimits.max_turns`` or the token budget.

Token ids in, token ids out: a turn's ids are the ids the sampler drew, which stops a calling
turn at the format's stop strings (the tag format's closing tags) inside its compiled loop; the
model's text is decoded only to parse its calls, never tokenized again. What follows a call is
exactly the format's text whatever the tokenizer merged into the call's last id (``seam``). A
result's text is tokenized once, as the format renders it, and its ids carry model mask 0: the
loss must not train on them.

The budget is TRL's: ``max_new_tokens`` counts the whole episode after the prompt, results
included; results that would overflow it are left out whole and the episode ends (TRL's
rollback), and a call in the last allowed turn is not run; both are counted (``Turn.not_run``).
A later turn continues each calling row from the KV cache of its turn before (``Resume``): only
the turn's last kept id and the results' ids are computed, not the prompt and the episode so
far. A sampler without a cache (a test's script) reads the row's whole context, which every
later turn also gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxgrpo.agents.episode import Episode
from jaxgrpo.agents.formats import ToolFormat
from jaxgrpo.agents.seam import cut_turn
from jaxgrpo.agents.share import RowShare
from jaxgrpo.agents.tools import Toolbox
from jaxgrpo.models.tokenizer import bucket_length
from jaxgrpo.sampling.generate import APPEND, earlier_width

# sample(ids [N, P], mask [N, P], num_samples, max_lengths [N * num_samples] or None, turn,
# resume) -> an object with tokens, logprobs, temperatures [N * num_samples, T] and lengths
# [N * num_samples] (a `jaxgrpo.sampling.SampleOutput`). ids are the prompts at turn 0, every
# row's whole context later; resume is None at turn 0, then the `Resume` of the turn.
Sampler = Callable[[np.ndarray, np.ndarray, int, np.ndarray | None, int, Any], Any]


@dataclasses.dataclass(frozen=True)
class Resume:
    """How a later turn's N rows continue from the cache of the sampler's previous call
    (``jaxgrpo.sampling.resume_from_state``'s arguments).

    Attributes:
      rows: [N] the rows of the previous call that go on.
      valid_until: [N] each row's completion slots before this one hold its episode; later
        ones hold ids sampled past the turn's cut.
      positions: [N] the position id of each row's first appended id.
      ids / mask: [N, K] left-padded to a multiple of ``APPEND`` (one resume pass each):
        each row's last kept id (which may not be in the cache: a row's last sampled id is not
        fed back), then its results' ids.
      width: completion slots that hold every row's earlier ids (``earlier_width``).
    """

    rows: np.ndarray
    valid_until: np.ndarray
    positions: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    width: int


@dataclasses.dataclass(frozen=True)
class AgentLimits:
    """Limits of one episode.

    Attributes:
      max_turns: model turns at most (TRL's ``max_tool_calling_iterations`` + 1).
      max_tool_tokens: tokens of one result at most; a longer result is cut and counted.
      tool_timeout_s: wall time of one call at most.
    """

    max_turns: int = 4
    max_tool_tokens: int = 256
    tool_timeout_s: float = 10.0


@dataclasses.dataclass
class EpisodeBatch:
    """R episodes as arrays [R, T] (T = the token budget), left-aligned after each prompt.

    Attributes:
      tokens: every id of the episode (``pad_id`` after it).
      mask: 1 on the episode's ids, model and tool alike (what later tokens attend).
      model_mask: 1 on the ids the model drew (what the loss trains), 0 on results and padding.
      logprobs / temperatures: the sampler's, on model ids; 0 and 1 elsewhere.
      lengths: ids per episode.
      truncated: bool, the episodes that used their whole budget without ending their last
        turn (with a stop token): ``completion/truncated_frac`` and ``rl.mask_truncated``.
      episodes: the turns, calls and results of each row (`Episode`).
      environments: each row's environment after its episode (as its owner's process left
        it), or None without an environment (``Agent.run`` sets them).
    """

    tokens: np.ndarray
    mask: np.ndarray
    model_mask: np.ndarray
    logprobs: np.ndarray
    temperatures: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    episodes: list[Episode]
    environments: list | None = None


@dataclasses.dataclass
class _Row:
    prompt: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    model: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    temperatures: list[float] = dataclasses.field(default_factory=list)
    episode: Episode = dataclasses.field(default_factory=Episode)

    def extend(self, ids, model: int, logprobs=None, temperatures=None) -> None:
        self.ids += [int(i) for i in ids]
        self.model += [model] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        self.temperatures += (
            [1.0] * len(ids) if temperatures is None else [float(x) for x in temperatures]
        )


def _result_texts(tokenizer: Any, calls, results, limit: int) -> tuple[list, int]:
    """(name, text) of a turn's results, each text first cut to ``limit`` tokens; and how
    many were cut."""
    texts, cut = [], 0
    for call, result in zip(calls, results, strict=True):
        ids = tokenizer.hf.encode(result.text, add_special_tokens=False)
        text = result.text
        if len(ids) > limit:
            text, cut = tokenizer.hf.decode(ids[:limit]), cut + 1
        texts.append((call.name or "", text))
    return texts, cut


def _left_padded(rows: Sequence[list[int]], pad_id: int, width: int) -> tuple:
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def run_episodes(
    sample: Sampler,
    tokenizer: Any,
    fmt: ToolFormat,
    toolboxes: Sequence[Toolbox | None],
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    *,
    group: int,
    max_new_tokens: int,
    limits: AgentLimits = AgentLimits(),
    share: RowShare = RowShare(),
) -> EpisodeBatch:
    """R = B * G episodes from B left-padded prompts, one toolbox per row (an environment's
    state is the row's own). Each row's calls run on the process that owns it (``share``; a
    toolbox is needed only there, None elsewhere); every process gets every row's results.

    Returns:
      The ``EpisodeBatch``; every call's failure is in its episode's results, none raised.
    """
    prompt_ids, prompt_mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    n_rows = prompt_ids.shape[0] * group
    if len(toolboxes) != n_rows:
        raise ValueError(f"{len(toolboxes)} toolboxes for {n_rows} rows (one per row)")
    prompts = [ids[mask != 0].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    rows = [_Row(prompts[r // group]) for r in range(n_rows)]
    eos, stop_strings = set(tokenizer.eos_ids), fmt.stop_strings()
    out = sample(prompt_ids, prompt_mask, group, None, 0, None)
    live, start = list(range(n_rows)), 0  # start: the completion slot of a turn's first id
    for turn in range(limits.max_turns):
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        logprobs, temps = np.asarray(out.logprobs), np.asarray(out.temperatures)
        calling = {}  # row -> (row in the call, its seam, text, calls, whether it ended)
        for i, r in enumerate(live):
            row, ids = rows[r], tokens[i, : int(lengths[i])].tolist()
            seam = cut_turn(tokenizer, ids, stop_strings)
            # A turn cut at a stop string goes on after its results; one that sampled its
            # end-of-turn id has the format's text follow that id.
            ended = not seam.at_stop and bool(ids) and ids[-1] in eos
            text = tokenizer.hf.decode(ids[:-1], skip_special_tokens=False) if ended else seam.text
            calls = fmt.parse(text)
            last = turn == limits.max_turns - 1 or max_new_tokens - len(row.ids) - len(seam.ids) < 1
            if calls and not last:
                calling[r] = (i, seam, text, calls, ended)
                continue
            keep = len(seam.ids)
            row.extend(seam.ids, 1, logprobs[i, :keep], temps[i, :keep])
            row.episode.add_turn(text, not_run=len(calls))
        # Each row's calls run on its owner's process only; every process gets the results.
        # A turn's async calls run concurrently (``Toolbox.run_all``).
        run = lambda r, calls=calling: toolboxes[r].run_all(  # noqa: E731
            calls[r][3], limits.tool_timeout_s
        )
        results = share.map_rows(calling, n_rows, run, "a tool result")
        going, resume = [], []
        for r, (i, seam, text, calls, ended) in calling.items():
            row = rows[r]
            texts, cut = _result_texts(tokenizer, calls, results[r], limits.max_tool_tokens)
            follow = fmt.render_results(texts)
            if not fmt.same_turn and not ended:
                follow = fmt.turn_end + follow  # the turn was cut before its end-of-turn id
            kept, tail = seam.join(follow)
            appended = tokenizer.hf.encode(tail, add_special_tokens=False)
            if len(row.ids) + len(kept) + len(appended) > max_new_tokens:
                # Results that overflow the budget are left out whole (TRL rolls them back):
                # the episode ends with the call's turn, its calls counted as not run.
                kept, appended = seam.ids, []
            n = len(kept)
            row.extend(kept, 1, logprobs[i, :n], temps[i, :n])
            if not appended:
                row.episode.add_turn(text, not_run=len(calls))
                continue
            row.episode.add_turn(text, calls, results[r], cut)
            row.extend(appended, 0)
            if len(row.ids) < max_new_tokens:
                going.append(r)
                # (row in the call, slots it keeps, chunk: the last kept id and the results)
                resume.append((i, start + len(kept) - 1, [kept[-1], *appended]))
        if not going:
            break
        live = going
        # Every later turn has the batch's rows (those that did not call padded with a
        # budget of 1) and one cache width, so its programs compile once per result width.
        extra = n_rows - len(live)
        contexts = [rows[r].prompt + rows[r].ids for r in live]
        budget = [max_new_tokens - len(rows[r].ids) for r in live]
        width = bucket_length(max(map(len, contexts)), 16)
        ids, mask = _left_padded(contexts + contexts[:1] * extra, tokenizer.pad_id, width)
        step = _resume(resume, [rows[r] for r in live], extra, tokenizer.pad_id, max_new_tokens)
        start = step.width + step.ids.shape[1]
        out = sample(ids, mask, 1, np.asarray(budget + [1] * extra, np.int32), turn + 1, step)
    return _as_batch(rows, max_new_tokens, tokenizer.pad_id, eos)


def warm_later_turns(
    sample: Sampler,
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    *,
    group: int,
    max_new_tokens: int,
    pad_id: int,
) -> None:
    """Compiles every program a later turn of these prompts' episodes can run, so that no
    step after this one compiles: a first turn's cache laid out for the later turns
    (``pack``), then their one ``resume`` and one ``decode``, from that cache and from a later
    turn's. Each call samples one token per row, from dummy ids, and is thrown away."""
    n = np.asarray(prompt_ids).shape[0] * group
    ones = np.ones(n, np.int32)
    ids = np.full((n, APPEND), pad_id, np.int32)
    mask = np.zeros((n, APPEND), np.int32)
    mask[:, -1] = 1
    rows = np.arange(n, dtype=np.int32)
    step = Resume(rows, ones, ones * prompt_ids.shape[1], ids, mask, earlier_width(max_new_tokens))
    sample(prompt_ids, prompt_mask, group, ones, 0, None)
    for turn in (1, 2):
        sample(step.ids, step.mask, 1, ones, turn, step)


def _resume(going: Sequence[tuple], rows: Sequence[_Row], extra: int, pad_id: int, t: int):
    """The ``Resume`` of a later turn: ``going`` holds (row in the previous call, slots it
    keeps, its chunk) for each of ``rows`` (already extended by the chunk), then ``extra``
    padding rows repeat the first. Chunks are left-padded to a multiple of ``APPEND`` ids."""
    earlier = [len(row.ids) - len(chunk) for row, (_, _, chunk) in zip(rows, going, strict=True)]
    positions = [len(row.prompt) + n for row, n in zip(rows, earlier, strict=True)]
    chunks = [chunk for _, _, chunk in going]
    ids, mask = _left_padded(chunks, pad_id, -(-max(map(len, chunks)) // APPEND) * APPEND)
    pad = lambda x: np.concatenate([np.asarray(x), np.asarray(x)[:1].repeat(extra, 0)])  # noqa: E731
    return Resume(
        rows=pad([i for i, _, _ in going]).astype(np.int32),
        valid_until=pad([v for _, v, _ in going]).astype(np.int32),
        positions=pad(positions).astype(np.int32),
        ids=pad(ids),
        mask=pad(mask),
        width=earlier_width(t),
    )


def _as_batch(rows: Sequence[_Row], t: int, pad_id: int, eos: set[int]) -> EpisodeBatch:
    r = len(rows)
    batch = EpisodeBatch(
        tokens=np.full((r, t), pad_id, np.int32),
        mask=np.zeros((r, t), np.int32),
        model_mask=np.zeros((r, t), np.int32),
        logprobs=np.zeros((r, t), np.float32),
        temperatures=np.ones((r, t), np.float32),
        lengths=np.zeros((r,), np.int32),
        truncated=np.array([len(row.ids) >= t and row.ids[-1] not in eos for row in rows], bool),
        episodes=[row.episode for row in rows],
    )
    for i, row in enumerate(rows):
        n = min(len(row.ids), t)
        batch.tokens[i, :n] = row.ids[:n]
        batch.mask[i, :n] = 1
        batch.model_mask[i, :n] = row.model[:n]
        batch.logprobs[i, :n] = row.logprobs[:n]
        batch.temperatures[i, :n] = row.temperatures[:n]
        batch.lengths[i] = n
    return batch


def model_sampler(generate_fn: Callable, settings: Any, rng: Any) -> Sampler:
    """A ``Sampler`` over ``generate_fn(ids, mask, settings, rng=...)`` (e.g.
    ``functools.partial(jaxgrpo.sampling.generate, model)``) that samples every turn from the
    whole context, keeping no cache (the reference the cache's turns are tested against):
    each turn draws with its own key (``fold_in(rng, turn)``), the turn's samples per prompt
    and per-row budgets."""
    import jax

    def sample(ids, mask, num_samples, max_lengths, turn, resume=None):
        s = dataclasses.replace(settings, num_samples=num_samples, max_lengths=max_lengths)
        return generate_fn(ids, mask, s, rng=jax.random.fold_in(rng, turn))

    return sample
