"""Collectives of a compiled program, read from its HLO text: each collective op's count and
bytes, with while-loop bodies weighted by their trip counts (XLA's known trip count, else the
loop's constant bound, else the caller's), so a decode loop's per-token collectives are
counted T times."""

from __future__ import annotations

import re
from typing import Any

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")
_WHILE = re.compile(r"body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_COND = re.compile(r"condition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"= s32\[\]\S* constant\((\d+)\)")


def _counted_trips(comps: dict, while_line: str) -> int | None:
    """A loop's trip count: XLA's ``known_trip_count``, else the bound of a condition that is
    one ``counter < constant`` (a ``lax.scan``, whose count XLA:TPU does not annotate)."""
    trips = _TRIPS.search(while_line)
    if trips:
        return int(trips.group(1))
    cond = _COND.search(while_line)
    lines = [line for _, _, line in comps.get(cond.group(1), [])] if cond else []
    bounds = [int(m.group(1)) for m in map(_CONSTANT.search, lines) if m]
    compares = [line for line in lines if " compare(" in line]
    if len(bounds) == 1 and len(compares) == 1 and "direction=LT" in compares[0]:
        return bounds[0]
    return None


def _bytes_of(type_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        count = 1
        for x in filter(None, dims.split(",")):
            count *= int(x)
        total += count * _DTYPE_BYTES.get(dtype, 4)
    return total


def _parse(hlo: str) -> tuple[dict, str]:
    """{computation: [(op, bytes, line)]} and the entry computation's name."""
    comps: dict[str, list] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        i = _INSTR.match(line)
        if current is not None and i:
            comps[current].append((i.group(2), _bytes_of(i.group(1)), line))
    return comps, entry


def _kind(op: str) -> str | None:
    base = op.removesuffix("-start")
    return base if base in COLLECTIVES else None


def collectives(hlo: str, unknown_trips: int = 1) -> dict[str, Any]:
    """Collectives of a compiled program: whole program (weighted by loop trip counts) and the
    first top-level while loop's body (once, i.e. one decode step for the sampler's loop, with
    the loops inside it, such as the scan over layers, weighted by their trip counts).

    Returns:
      ``{"program": {kind: {count, bytes}}, "loop_body": {...}, "loops": n}``; ``count`` and
      ``bytes`` in ``program`` are per execution (loop bodies times their trips; the top-level
      loops whose count XLA does not know share ``unknown_trips`` evenly, a nested one runs
      once per enclosing iteration).
    """
    comps, entry = _parse(hlo)
    total: dict[str, dict] = {}
    body_first: dict[str, dict] = {}
    loops = 0

    def add(into, kind, size, times):
        slot = into.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += times
        slot["bytes"] += size * times

    def walk(name, times, into_body, body_times, seen):
        """``times``: executions per program run; ``body_times``: per decode step."""
        nonlocal loops
        if name in seen or name not in comps:
            return
        seen = seen | {name}
        for op, size, line in comps[name]:
            kind = _kind(op)
            if kind:
                add(total, kind, size, times)
                if into_body is not None:
                    add(into_body, kind, size, body_times)
            if op == "while":
                body = _WHILE.search(line).group(1)
                trips = _counted_trips(comps, line)
                # Only a top-level loop is the sampler's decode loop; a nested loop that
                # cannot be counted (a sort, a search) counts once per enclosing iteration.
                n = trips if trips is not None else unknown_trips if name == entry else 1
                first, first_times = into_body, body_times * n
                if into_body is None and loops == 0 and name == entry:
                    first, first_times = body_first, 1  # one decode step: its layer scan x L
                if name == entry:
                    loops += 1
                walk(body, times * n, first, first_times, seen)
                continue
            for group in _CALLS.findall(line):
                for callee in group.replace("%", "").split(","):
                    walk(callee.strip(), times, into_body, body_times, seen)

    # The compaction levels' loops share the decode's T steps between them.
    top = [line for op, _, line in comps.get(entry, []) if op == "while"]
    uncounted = sum(_counted_trips(comps, x) is None for x in top)
    unknown_trips = max(1, unknown_trips // max(1, uncounted))
    walk(entry, 1, None, 1, frozenset())
    return {"program": total, "loop_body": body_first, "loops": loops}
