"""Where a decode step's milliseconds go: one traced ``generate`` call, its XLA:CPU ops grouped
by the jaxgrpo function that emitted them (a benchmark tool, not a test).

Workload as ``generate.py``: SmolLM2-135M-Instruct, 4 chat prompts x 8 samples, temperature 1,
no stop tokens, ``--new-tokens`` T. One warm-up call, then one call under ``jax.profiler``; every
XLA op of the decode program is attributed through its HLO metadata (source file and line) to
the function that emitted it: projections (split by weight), LM head, attention, cache writes,
norms and RoPE, token selection, loop bookkeeping. Per step = total / T. XLA:CPU runs
independent ops on two threads at once, so the per-op sum can exceed the wall time.

    python benchmarks/decode_profile.py --new-tokens 512
    python benchmarks/decode_profile.py --new-tokens 512 --cache-sizes none  # T slots at once
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time

from jaxgrpo.core.host import keep_freed_memory, use_cpu_xla_flags

use_cpu_xla_flags()
keep_freed_memory()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxgrpo.models import load_model  # noqa: E402
from jaxgrpo.models.aliases import smollm2_path  # noqa: E402
from jaxgrpo.sampling import SamplerSettings, sampler_programs  # noqa: E402

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain why the sky is blue to a child, briefly."}],
    [{"role": "user", "content": "List three prime numbers greater than 10."}],
]
# jaxgrpo function -> category of the decode step.
CATEGORIES = {
    "_project": "projections",
    "Transformer.logits": "LM head",
    "attend": "attention",
    "_masked_softmax": "attention",
    "decode_layer.<locals>.attend_fn": "cache writes",
    "rms_norm": "norms and RoPE",
    "apply_rope": "norms and RoPE",
    "rope_cos_sin": "norms and RoPE",
    "decoder_layer": "residual adds and SwiGLU",
    "decode_layer_from_block": "decode-layout weights (once per call)",
    "_by_kv_head": "decode-layout weights (once per call)",
    "_matrix": "decode-layout weights (once per call)",
}
# Projection outputs of SmolLM2-135M's decode layout, by width.
PROJECTIONS = {960: "q/k/v", 576: "o and down", 3072: "gate/up"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\S+) .*stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r"(\w+)=(\d+)")


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
    """The HLO text's FileNames, FunctionNames, FileLocations and StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif not line.strip() or line.startswith(("%", "HloModule", "ENTRY")):
            current = None if not line.strip() else current
        elif current is not None and (m := _TABLE_ROW.match(line)):
            current[int(m.group(1))] = m.group(2).strip('"')
    return tables


def op_categories(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> category: the innermost jaxgrpo function on its stack."""
    t = _tables(hlo_text)
    fields = lambda row: {k: int(v) for k, v in _FIELDS.findall(row)}  # noqa: E731

    def jaxgrpo_frame(frame: int) -> tuple[str, str] | None:
        seen = set()
        while frame and frame not in seen:
            seen.add(frame)
            f = fields(t["StackFrames"][frame])
            loc = fields(t["FileLocations"][f["file_location_id"]])
            path = t["FileNames"][loc["file_name_id"]]
            if "jaxgrpo" in path:
                return path, t["FunctionNames"][loc["function_name_id"]]
            frame = f.get("parent_frame_id", 0)
        return None

    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, frame = m.group(1), m.group(2), int(m.group(3))
        where = jaxgrpo_frame(frame) if t.get("StackFrames") else None
        if where is None:
            out[name] = "other"
            continue
        path, func = where
        if "sampling/select" in path:
            category = "token selection"
        elif "sampling/loop" in path:
            category = "loop bookkeeping"
        else:
            category = CATEGORIES.get(func, f"other ({func})")
        if category == "projections":
            width = int(shape.split("{")[0].rstrip("]").split(",")[-1])
            category = f"projections ({PROJECTIONS.get(width, width)})"
        out[name] = category
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8, help="G per prompt (4 prompts)")
    parser.add_argument("--cache-sizes", default="auto", help="'auto', 'none' or e.g. 128,512")
    args = parser.parse_args()
    t, g = args.new_tokens, args.samples
    sizes = {"auto": None, "none": ()}.get(args.cache_sizes)
    if args.cache_sizes not in ("auto", "none"):
        sizes = tuple(int(x) for x in args.cache_sizes.split(","))
    model, tok = load_model(smollm2_path())
    ids, mask = tok.encode_chat(CHATS)
    graphdef, state = nnx.split(model)
    settings = SamplerSettings(
        max_new_tokens=t,
        temperature=1.0,
        num_samples=g,
        eos_ids=(),
        compact_rows=0,
        cache_sizes=sizes,
    )
    prefill, decode, knobs = sampler_programs(graphdef, model.cfg, ids, settings)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def call(seed):
        s = prefill((state,), ids, mask, knobs, jax.random.key(seed))
        s.tokens_RT.block_until_ready()
        t0 = time.perf_counter()
        s = decode((state,), s, knobs)
        s.tokens_RT.block_until_ready()
        return time.perf_counter() - t0

    s0 = prefill((state,), ids, mask, knobs, jax.random.key(0))
    text = decode.lower((state,), s0, knobs).compile().as_text()
    categories = op_categories(text)
    call(0)
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        wall = call(1)
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    totals: collections.Counter = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "decode_fn" in str(stats.get("hlo_module", "")) and "hlo_op" in stats:
                    op = str(stats["hlo_op"])
                    totals[categories.get(op, "other")] += event.duration_ns
    steps = t - 1
    print(
        f"decode loop: {steps} steps of {ids.shape[0] * g} rows, cache sizes "
        f"{args.cache_sizes}; wall {wall * 1e3 / steps:.1f} ms per step, ops "
        f"{sum(totals.values()) / 1e6 / steps:.1f} ms per step"
    )
    for category, ns in totals.most_common():
        print(f"  {category:42} {ns / 1e6 / steps:8.2f} ms")


if __name__ == "__main__":
    main()
