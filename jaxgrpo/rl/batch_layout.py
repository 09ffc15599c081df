"""The batch layout the learner relies on: minibatches of whole groups, micro-batches split
evenly over the mesh's data-parallel devices."""

from __future__ import annotations

from typing import Any

from jaxgrpo.core.errors import config_require


def check_batch_layout(rl: Any, shards: int | None) -> None:
    """The batch split the learner relies on; checked by the config's ``validate`` (without
    shards) and by the ``Learner``.

    A minibatch holds whole groups, so ``num_minibatches * grad_accum`` must divide
    ``prompts_per_step``; a micro-batch of ``prompts_per_step * group_size /
    (num_minibatches * grad_accum)`` sequences is split over the ``data * fsdp`` devices
    (``shards``; None skips that part), so it must be a multiple of them.
    """
    split = rl.num_minibatches * rl.grad_accum
    key = "rl.grad_accum" if rl.grad_accum > 1 else "rl.num_minibatches"
    config_require(
        rl.prompts_per_step % split == 0,
        key,
        f"num_minibatches * grad_accum = {split} must divide rl.prompts_per_step = "
        f"{rl.prompts_per_step}: minibatches hold whole groups",
        getattr(rl, key[3:]),
    )
    if shards is None:
        return
    micro = rl.prompts_per_step * rl.group_size // split
    config_require(
        micro % shards == 0,
        "rl.prompts_per_step",
        f"a micro-batch of (prompts_per_step * group_size) / (num_minibatches * grad_accum)"
        f" = {micro} sequences must be divisible by mesh data * fsdp = {shards}",
        rl.prompts_per_step,
    )
