"""Which process runs what for an episode's row, and how the others learn its outcome.

In a run over several processes every process holds the whole batch (the sampler's output is
gathered to each), so all of them parse the same calls and agree on every turn. Only the tools
and the environments differ: a tool may be slow or have effects (a sandbox, a web request), and
an environment's state is whatever its calls did. So each row has one owner, the process that
creates its environment and runs its calls (rows split into contiguous blocks, one per process),
and ``RowShare.map_rows`` sends each owner's outcomes to every process, so the episodes, their
metrics and their rewards are the same everywhere. One process: nothing is sent or pickled.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterable
from typing import Any

from jaxgrpo.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class RowShare:
    """This process's part of a batch's rows.

    Attributes:
      index / count: this process and how many there are.
      gather: every process's bytes from this one's (a collective, in process order); needed
        when ``count > 1``.
    """

    index: int = 0
    count: int = 1
    gather: Callable[[bytes], list[bytes]] | None = None

    @classmethod
    def of_processes(cls) -> RowShare:
        """This JAX process's share (``jax.process_index`` of ``jax.process_count``)."""
        import jax

        from jaxgrpo.core.sharding import allgather_bytes

        if jax.process_count() == 1:
            return cls()
        return cls(jax.process_index(), jax.process_count(), allgather_bytes)

    def owner(self, row: int, n_rows: int) -> int:
        """The process that owns ``row`` of ``n_rows`` (contiguous blocks)."""
        return row * self.count // n_rows

    def owns(self, row: int, n_rows: int) -> bool:
        return self.owner(row, n_rows) == self.index

    def map_rows(
        self, rows: Iterable[int], n_rows: int, fn: Callable[[int], Any], what: str = "a value"
    ) -> dict[int, Any]:
        """``{row: fn(row)}`` for ``rows``, each ``fn(row)`` run by the row's owner only and
        the values sent to every process (pickled). Every process must call it with the same
        rows. An exception ``fn`` raised on any process is raised on every process (the owner
        re-raises its own): a ``UserError`` stays one, another becomes a ``RuntimeError``
        naming the process; ``what`` names the value in the error when it does not pickle."""
        rows = list(rows)
        if self.count == 1:
            return {r: fn(r) for r in rows}
        mine: dict[int, bytes] = {}
        failure: tuple[str, str] | None = None  # (kind, message), sent to every process
        error: BaseException | None = None  # the owner re-raises its own exception
        for r in (r for r in rows if self.owns(r, n_rows)):
            try:
                value = fn(r)
            except Exception as e:  # every process must reach the gather below
                error, kind = e, "user" if isinstance(e, UserError) else type(e).__name__
                failure = (kind, str(e))
                break
            try:
                mine[r] = pickle.dumps(value)
            except Exception as e:
                failure = ("user", _not_pickled(what, r, self.count, e))
                break
        merged: dict[int, Any] = {}
        failures = []
        for p, blob in enumerate(self.gather(pickle.dumps((mine, failure)))):
            theirs, their_failure = pickle.loads(blob)
            merged.update(theirs)
            if their_failure is not None:
                failures.append((p, *their_failure))
        if failures:
            if error is not None:
                raise error
            p, kind, message = failures[0]
            if kind == "user":
                raise UserError(message)
            raise RuntimeError(f"process {p}: {kind}: {message}")
        return {r: pickle.loads(merged[r]) for r in rows}


def _not_pickled(what: str, row: int, count: int, e: Exception) -> str:
    return (
        f"{what} of row {row} cannot be pickled ({type(e).__name__}: {e}); a run over {count} "
        "processes sends it from the process that owns the row to the others (give its class "
        "__getstate__ / __setstate__ that leave out what cannot be sent)"
    )
