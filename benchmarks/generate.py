"""Generation speed: jaxgrpo ``generate`` against transformers ``generate``, one process.

Same weights and workload on both sides: 4 chat prompts x 8 samples = 32 sequences, 128 new
tokens, float32, temperature 1.0 with no truncation (HF's default top_k=50 switched off), no
early stop (no stop tokens on our side, ``min_new_tokens`` on HF's). One warm-up call, then the
fastest of ``--repeats`` timed calls of each length. A decode step's time is (full call -
prefill-only call) / (T - 1), compared with the machine's floor for that step: the larger of
weight bytes / measured copy bandwidth and 2 * params * batch / measured matmul rate. The step
at position p (``--positions``) is (call of p tokens - call of p - 64 tokens) / 64 (from 1 token
for p <= 64), each call the fastest of ``--repeats``: it shows whether a step's cost grows with
the tokens written so far or is set by ``--new-tokens``.

    python benchmarks/generate.py                        # SmolLM2-135M-Instruct (GGUF, both)
    python benchmarks/generate.py --model qwen2.5-0.5b   # random weights at Qwen2.5-0.5B shape
    python benchmarks/generate.py --new-tokens 512 --repeats 1   # the seed study's length

Not a test: it takes minutes, and other processes on the machine make the figures noisy.
"""

import argparse
import os
import time

from jaxgrpo.core.host import keep_freed_memory, use_cpu_xla_flags

# Before torch or JAX start threads: the malloc settings the CLIs run with (jaxgrpo.run.runtime).
# They hold for the whole process, so transformers runs under them too.
keep_freed_memory()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxgrpo.models import load_model  # noqa: E402
from jaxgrpo.models.config import ModelConfig  # noqa: E402
from jaxgrpo.models.tokenizer import Tokenizer  # noqa: E402
from jaxgrpo.models.transformer import Transformer  # noqa: E402
from jaxgrpo.models.weights import load_hf_tensors  # noqa: E402
from jaxgrpo.sampling import SamplerSettings, generate  # noqa: E402

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain why the sky is blue to a child, briefly."}],
    [{"role": "user", "content": "List three prime numbers greater than 10."}],
]

QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B-Instruct config.json
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def load_models(name: str):
    """(our model, HF torch model, tokenizer) holding the same float32 weights."""
    from jaxgrpo.models.aliases import smollm2_path

    gguf = smollm2_path()
    if name == "smollm2":
        ours, tok = load_model(gguf)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
        )
        return ours, hf.eval(), tok
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(**QWEN25_05B)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    from flax import nnx

    ours = Transformer(ModelConfig.from_hf_config(hf_cfg.to_dict()), rngs=nnx.Rngs(0))
    sd = hf.state_dict()
    load_hf_tensors(ours, lambda n: sd[n].numpy())
    return ours, hf, Tokenizer.from_gguf(gguf)  # SmolLM2's tokenizer only makes the prompt ids


def machine_floor(weight_bytes: int, params: int, batch: int) -> dict:
    """Measured copy bandwidth and matmul rate, and the floor they give one decode step."""
    src = np.ones(64 * 2**20, np.float32)  # 256 MiB
    dst = np.empty_like(src)
    copy_s = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    bandwidth = 2 * src.nbytes / copy_s  # read + write
    a = jax.numpy.ones((2048, 2048), jax.numpy.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    mm_s = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    flops = 2 * 2048**3 / mm_s
    mem_floor, compute_floor = weight_bytes / bandwidth, 2 * params * batch / flops
    return dict(
        bandwidth_gbs=bandwidth / 1e9,
        matmul_gflops=flops / 1e9,
        mem_floor_ms=mem_floor * 1e3,
        compute_floor_ms=compute_floor * 1e3,
        floor_ms=max(mem_floor, compute_floor) * 1e3,
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


WINDOW = 64  # tokens between the two calls that time a position


def call_lengths(t: int, positions: list[int]) -> list[int]:
    """The completion lengths to time: 1 (the prefill), each position p and p - WINDOW, and T."""
    wanted = {1, t} | set(positions) | {max(p - WINDOW, 1) for p in positions}
    return sorted(x for x in wanted if 1 <= x <= t)


def per_token_ms(seconds: dict[int, float], positions: list[int]) -> dict[int, float]:
    """Milliseconds per decode step at position p: (time to p - time to p - WINDOW) / WINDOW."""
    out = {}
    for p in positions:
        lo = max(p - WINDOW, 1)
        if p in seconds and p > lo:
            out[p] = (seconds[p] - seconds[lo]) / (p - lo) * 1e3
    return out


def run_ours(
    model, ids, mask, g: int, t: int, repeats: int, lengths: list[int], cache_sizes=None
) -> dict:
    """Fastest of ``repeats`` calls that stop every row after each of ``lengths`` tokens."""
    settings = SamplerSettings(
        max_new_tokens=t,
        temperature=1.0,
        num_samples=g,
        eos_ids=(),
        compact_rows=0,  # every row stops at once: one program pair for every length
        cache_sizes=cache_sizes,
    )

    def call(length, seed=0):
        out = generate(model, ids, mask, settings, rng=jax.random.key(seed), max_lengths=length)
        out.tokens.block_until_ready()
        assert int(out.lengths.min()) == length, "every row must run `length` tokens"
        return out

    # Per-row lengths are traced: a length-1 call compiles the programs every length uses.
    call(1)
    return {
        n: min(_timed(lambda i=i, n=n: call(n, seed=i)) for i in range(repeats)) for n in lengths
    }


def run_hf(hf, ids, mask, g: int, t: int, repeats: int, lengths: list[int]) -> dict:
    """Fastest of ``repeats`` ``generate`` calls of each of ``lengths`` new tokens."""
    ids_t, mask_t = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def call(new):
        with torch.no_grad():
            return hf.generate(
                input_ids=ids_t,
                attention_mask=mask_t,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=g,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )

    call(4)
    return {n: min(_timed(lambda n=n: call(n)) for _ in range(repeats)) for n in lengths}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    use_cpu_xla_flags()  # the XLA:CPU flags the CLIs run with (jaxgrpo.run.runtime)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "qwen2.5-0.5b"])
    parser.add_argument("--samples", type=int, default=8, help="G per prompt (4 prompts)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="time jaxgrpo only")
    parser.add_argument(
        "--cache-sizes",
        choices=["auto", "none"],
        default="auto",
        help="jaxgrpo's completion cache: grown by sizes (auto) or all T slots at once (none)",
    )
    parser.add_argument(
        "--positions",
        type=lambda x: [int(p) for p in x.split(",")],
        default=[32, 128, 256, 512],
        help="decode positions to time one step at (those <= --new-tokens)",
    )
    args = parser.parse_args()
    g, t = args.samples, args.new_tokens

    model, hf, tok = load_models(args.model)
    ids, mask = tok.encode_chat(CHATS)
    n = ids.shape[0] * g
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model))
    params = sum(x.size for x in leaves)
    floor = machine_floor(sum(x.nbytes for x in leaves), params, n)
    print(
        f"model {args.model}: {params / 1e6:.1f}M params, prompts {ids.shape}, N={n}, T={t}, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, torch threads "
        f"{torch.get_num_threads()}"
    )
    print(
        f"machine: copy {floor['bandwidth_gbs']:.1f} GB/s, matmul {floor['matmul_gflops']:.0f} "
        f"GFLOP/s -> step floor {floor['floor_ms']:.1f} ms (memory {floor['mem_floor_ms']:.1f}"
        f", compute {floor['compute_floor_ms']:.1f})"
    )

    positions = [p for p in args.positions if p <= t]
    lengths = call_lengths(t, positions)
    head = "".join(f"{f'ms @{p}':>10}" for p in positions)
    print(
        f"{'':14}{'tokens/s':>10}{'call s':>9}{'prefill s':>11}{'step ms':>9}{'x floor':>9}{head}"
    )
    sizes = None if args.cache_sizes == "auto" else ()
    sides = [("jaxgrpo", lambda: run_ours(model, ids, mask, g, t, args.repeats, lengths, sizes))]
    if not args.skip_hf:
        sides.append(("transformers", lambda: run_hf(hf, ids, mask, g, t, args.repeats, lengths)))
    rates = []
    for name, run in sides:  # each row is printed as soon as it is measured
        seconds = run()
        full, prefill = seconds[t], seconds[1]
        step_ms = (full - prefill) / (t - 1) * 1e3
        rates.append(n * t / full)
        at = per_token_ms(seconds, positions)
        print(
            f"{name:14}{rates[-1]:10.1f}{full:9.2f}{prefill:11.2f}{step_ms:9.1f}"
            f"{step_ms / floor['floor_ms']:9.2f}" + "".join(f"{at[p]:10.1f}" for p in positions),
            flush=True,
        )
    if len(rates) == 2:
        print(f"speed-up jaxgrpo / transformers: {rates[0] / rates[1]:.2f}x tokens/s")


if __name__ == "__main__":
    main()
