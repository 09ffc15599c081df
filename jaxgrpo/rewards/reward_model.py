"""A reward model as a reward function: TRL's ``reward_funcs=<model id>``.

A ``rewards.functions`` entry whose name is a checkpoint directory or a hub id ``org/name``
(``is_model_source``) names a sequence-classification model with one label
(``jaxgrpo.models.classifier``); each completion scores that model's output, as in TRL's
GRPOTrainer:

- The text is re-encoded with the reward model's own tokenizer. Where the data's rows are chats,
  the prompt's messages plus the completion as an assistant message (with tools, the episode's
  messages, results included) go through the reward model's chat template; otherwise the prompt
  string and the completion string are concatenated. Either way the text is tokenized without
  special tokens added, as TRL does. It is always the completion as given: what a tool returned
  is part of an episode's completion, as it is in TRL.
- Padding is the tokenizer's pad id (its eos when it has none, as TRL sets the model's
  ``pad_token_id``), on the right; the score is read at the last token that is not padding.
- A text longer than ``max_length`` tokens keeps its last ``max_length`` (TRL does not cut):
  the score is read at the end, so the prompt's beginning is what goes. A text of no token
  scores None.

Rows are sorted by length and scored ``batch_size`` at a time, each batch padded to a power-of-
two number of rows and of tokens (``bucket_length``), so few shapes compile; the scoring program
(``classifier.scoring_program``) runs on the run's mesh. The seconds a call takes are reported
through TRL's ``log_metric`` as ``time/reward_model``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo.core import sharding
from jaxgrpo.core.presets import RANDOM_PREFIX
from jaxgrpo.models.classifier import SequenceClassifier, load_classifier, scoring_program
from jaxgrpo.models.tokenizer import Tokenizer, bucket_length

OPTIONS = ("batch_size", "max_length")  # the kwargs of a reward model's rewards.functions entry
DEFAULT_BATCH_SIZE = 16  # rows per scoring call
DEFAULT_MAX_LENGTH = 2048  # tokens of a text; longer ones keep their end
TIME_METRIC = "time/reward_model"


def is_model_source(name: str) -> bool:
    """Whether a ``rewards.functions`` name is a reward model: a path (it has a ``/``, which no
    registry name or dotted path has), an existing directory with a ``config.json``, or
    ``random:<name>`` (random weights of a preset's shape)."""
    path = os.path.expanduser(name)
    if name.startswith(RANDOM_PREFIX):  # random weights of a preset's shape (compile checks)
        return True
    return "/" in name or os.path.isfile(os.path.join(path, "config.json"))


class RewardModel:
    """The reward function of one frozen sequence classifier and its tokenizer.

    The weights are held as the state ``nnx.split`` gives, the graphdef closed over by the
    jitted scoring program.

    Args:
      model: a ``SequenceClassifier``; its ``cfg.pad_id`` should be ``tokenizer.pad_id``.
      tokenizer: the reward model's own tokenizer.
      mesh: where the batches go (rows over the batch axes); None: one device.
      name: what the reward is reported as (``reward/<name>/...``).
      max_length: the longest text in tokens; longer ones keep their end.
      batch_size: rows per scoring call at most.
      min_bucket: fewest tokens a batch is padded to.
    """

    trl_arguments = True  # RewardSet passes TRL's prompts and completions (messages for chats)

    def __init__(
        self,
        model: SequenceClassifier,
        tokenizer: Tokenizer,
        *,
        mesh: Mesh | None = None,
        name: str = "reward_model",
        max_length: int = DEFAULT_MAX_LENGTH,
        batch_size: int = DEFAULT_BATCH_SIZE,
        min_bucket: int = 16,
    ):
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"max_length and batch_size must be >= 1: {max_length, batch_size}")
        self.tokenizer = tokenizer
        self.pad_id = model.cfg.pad_id
        self.mesh = mesh
        self.max_length = max_length
        self.batch_size = batch_size
        self.min_bucket = min(min_bucket, max_length)
        _, self.state = nnx.split(model)
        self._program = scoring_program(model, mesh)
        self.__name__ = name

    def text(self, prompt: str | list[dict], completion: str | list[dict]) -> str:
        """What the reward model reads: TRL's text of one prompt and completion."""
        if isinstance(prompt, str):
            return prompt + completion
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(
            list(prompt) + list(completion), add_generation_prompt=False
        )

    def encode(self, text: str) -> list[int]:
        """The text's ids without special tokens added, its last ``max_length``."""
        ids = self.tokenizer.hf.encode(text, add_special_tokens=False)
        return list(ids[-self.max_length :])

    def scores(self, rows: Sequence[list[int]]) -> np.ndarray:
        """[N] float64 score of each row of ids (NaN for an empty row)."""
        out = np.full(len(rows), np.nan)
        order = sorted((i for i, r in enumerate(rows) if r), key=lambda i: len(rows[i]))
        for start in range(0, len(order), self.batch_size):
            part = order[start : start + self.batch_size]
            out[part] = self._score_batch([rows[i] for i in part])
        return out

    def _score_batch(self, rows: list[list[int]]) -> np.ndarray:
        """Scores of up to ``batch_size`` non-empty rows, right-padded to a bucket."""
        b = bucket_length(len(rows), 1, self.batch_size)
        t = bucket_length(max(len(r) for r in rows), self.min_bucket, self.max_length)
        pad = 0 if self.pad_id is None else self.pad_id
        ids_BT, mask_BT = np.full((b, t), pad, np.int32), np.zeros((b, t), np.int32)
        for i, r in enumerate(rows):
            ids_BT[i, : len(r)], mask_BT[i, : len(r)] = r, 1
        if self.mesh is not None:
            ids_BT, mask_BT = (sharding.put_batch(x, self.mesh) for x in (ids_BT, mask_BT))
        scores_B = sharding.to_host(self._program(self.state, ids_BT, mask_BT))
        return scores_B[: len(rows)].astype(np.float64)

    def __call__(
        self,
        prompts: Sequence[str | list[dict]],
        completions: Sequence[str | list[dict]],
        *,
        log_metric: Callable[[str, float], None] | None = None,
        **_,
    ) -> list[float | None]:
        """One score per completion (None for a text of no token); the call's seconds go to
        ``log_metric`` as ``time/reward_model``."""
        start = time.perf_counter()
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        values = self.scores([self.encode(t) for t in texts])
        if log_metric is not None:
            log_metric(TIME_METRIC, time.perf_counter() - start)
        return [None if np.isnan(v) else float(v) for v in values]


def load_reward_model(
    source: str,
    *,
    mesh: Mesh | None = None,
    rules: sharding.Rules | None = None,
    dtype: str = "float32",
    param_dtype: str | None = None,
    **options,
) -> RewardModel:
    """The reward function of the classifier at ``source`` (``load_classifier``), its pad id
    the tokenizer's as TRL sets it, reported under the checkpoint's last path component.

    Args:
      source: a directory or hub id.
      mesh / rules / dtype / param_dtype: as ``load_classifier``'s.
      **options: ``RewardModel``'s ``max_length`` and ``batch_size``.
    """
    model, tokenizer = load_classifier(
        source, mesh=mesh, rules=rules, dtype=dtype, param_dtype=param_dtype, pad_id="tokenizer"
    )
    name = os.path.basename(os.path.normpath(source))
    return RewardModel(model, tokenizer, mesh=mesh, name=name, **options)
