"""Delta-NLL perplexity reward on a tiny random Llama, against a NumPy computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.tiny import tiny_model_config, tiny_tokenizer
from jaxgrpo.models.transformer import Transformer
from jaxgrpo.rewards import perplexity as ppl


def _random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Random weights drawn by NumPy into an abstract Transformer (norm scales = 1).

    Eager ``Transformer(cfg, rngs=...)`` dispatches one jax.random call per parameter, which
    took 17 s on the shared CI machine; the reward's correctness does not depend on the init.
    """
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def init(path, leaf):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(rng.normal(0.0, 0.1, leaf.shape).astype(leaf.dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, state))


@pytest.fixture(scope="module")
def tiny():
    """The tiny 2-layer Llama (D=64, V=384) and its jaxgrpo Tokenizer (ChatML byte-level BPE)."""
    tok = tiny_tokenizer()
    cfg = tiny_model_config()
    model = _random_model(cfg)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    # One shared reward instance, so its jitted function compiles once for the tests below.
    reward = ppl.make_perplexity_reward(model, tok, batch_size=2, chunk=16, min_bucket=64)
    return model, tok, (lambda ids: forward(state, ids)), reward


def _numpy_nll(tiny, prompt: str, text: str, max_length: int) -> float:
    """Mean -log p of `text`'s tokens after prompt || <reasoning>, from one row's logits.

    The row is right-padded to 64 with no attention mask: causal attention keeps the logits of
    the real prefix exact, and one fixed shape keeps the reference to a single compilation.
    """
    _, tok, forward, _ = tiny
    enc = lambda s: tok.hf.encode(s, add_special_tokens=False)
    head = enc(prompt) + enc(ppl.SEPARATOR)
    ids = (head + enc(text))[:max_length]
    assert len(ids) <= 64, len(ids)
    padded = np.zeros((1, 64), np.int32)
    padded[0, : len(ids)] = ids
    logits = np.asarray(forward(padded), np.float64)[0, : len(ids)]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    scored = [-logp[j - 1, ids[j]] for j in range(len(head), len(ids))]
    return float(np.mean(scored)) if scored else float("nan")


def test_reward_equals_numpy_from_model_logits(tiny):
    """tanh(NLL_ref - NLL_gen) per sample, with batching/padding/chunking across rows of
    different lengths (batch_size=2 forces several calls and a row-padded last call), on
    chat-rendered prompts whose special tokens must not be re-added or split."""
    tok = tiny[1]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Q: 48 clips?", "Q: how far in km?", "Q: x", "Q: y")
    ]
    completions = [
        "Half of 48 is 24. <answer>72</answer>",
        "80 + 65 + 50 = 195 km, so 195 km. <answer>195</answer>",
        "<answer>1</answer>",  # Empty reasoning: -1.
        "step by step",
    ]
    reference = ["So she sold 48 + 24 = 72 clips.", "The train goes 195 km.", "ref", None]
    reward = tiny[3]
    got = reward(prompts, completions, reference=reference)

    gens = [ppl.reasoning_text(c) for c in completions]
    for i in range(2):
        want = np.tanh(
            _numpy_nll(tiny, prompts[i], reference[i], 2048)
            - _numpy_nll(tiny, prompts[i], gens[i], 2048)
        )
        assert got[i] == pytest.approx(want, abs=1e-4), (i, got[i], want)
    assert got[2] == -1.0 and got[3] is None
    # A group (shared prompt and reference, scored once) gives each member its own reward.
    group = reward(
        [prompts[0]] * 3,
        [completions[0], completions[1], completions[0]],
        reference=[reference[0]] * 3,
    )
    assert group[0] == group[2] == pytest.approx(got[0], abs=1e-6) and group[1] != group[0]
    assert -1.0 < got[0] < 1.0 and got[0] != got[1]


def test_truncation_to_max_length(tiny):
    """Sequences are cut to max_length tokens; the average covers the surviving text tokens,
    and a reference with no surviving token scores None."""
    model, tok = tiny[:2]
    prompt, ref, gen = "Q: 48 clips?", "So she sold 72 clips. " * 4, "Half of 48 is 24. " * 4
    reward = ppl.make_perplexity_reward(model, tok, max_length=24, chunk=16)
    want = np.tanh(_numpy_nll(tiny, prompt, ref, 24) - _numpy_nll(tiny, prompt, gen, 24))
    assert reward([prompt], [gen], reference=[ref])[0] == pytest.approx(want, abs=1e-4)
    long_prompt = "Q: " + "48 clips " * 30
    assert reward([long_prompt], [gen], reference=[ref]) == [None]


def test_sign_more_likely_generation_scores_positive(tiny):
    """Generating the reference itself gives delta = 0; a text the model finds likelier than the
    reference (here: the reference's own most-repeated token) scores > 0, and vice versa."""
    reward = tiny[3]
    prompt, ref = "Q: 48 clips?", "So she sold 48 + 24 = 72 clips."
    assert reward([prompt], [ref], reference=[ref])[0] == pytest.approx(0.0, abs=1e-6)
    nll_ref, nll_alt = reward.nll([prompt, prompt], [ref, "clips clips clips"])
    r = reward([prompt], ["clips clips clips"], reference=[ref])[0]
    assert np.sign(r) == np.sign(nll_ref - nll_alt) and r != 0.0


def test_registry_form_caches_per_model_and_requires_model(tiny):
    model, tok = tiny[:2]
    text = "<|im_start|>user\nQ: 48?<|im_end|>"
    assert ppl._text_encoder(tok)(text) == ppl._text_encoder(tok.hf.backend_tokenizer)(text)
    assert ppl._text_encoder(tok)(text)[0] == tok.hf.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(ValueError, match="needs the frozen base model"):
        ppl.perplexity(["p"], ["c"], reference=["r"])
    a = ppl.perplexity(
        ["Q: 48 clips?"], ["Half of 48"], reference=["So 72"], model=model, tokenizer=tok
    )
    b = ppl.perplexity(
        ["Q: 48 clips?"], ["Half of 48"], reference=["So 72"], model=model, tokenizer=tok
    )
    assert a == b and len(ppl._CACHE[model]) == 1


@pytest.mark.slow
def test_real_smollm2_prefers_a_correct_paraphrase_to_gibberish(smollm2_gguf):
    """Under the real SmolLM2-135M-Instruct: the reference itself scores 0, a paraphrase of it
    scores above word salad, and an empty reasoning scores -1 (the sign convention end to end)."""
    from jaxgrpo.models import load_model

    model, tok = load_model(smollm2_gguf)
    reward = ppl.make_perplexity_reward(model, tok, batch_size=4)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Ana had 48 clips and sold half of them. How many are left?"}]
    )
    ref = "Half of 48 is 48 / 2 = 24, so Ana has 24 clips left."
    completions = [
        f"{ref} <answer>24</answer>",
        "She sold half of the 48 clips, which is 24, so 24 clips are left. <answer>24</answer>",
        "zebra quantum purple flask ocean of of seventeen <answer>24</answer>",
        "<answer>24</answer>",
    ]
    same, paraphrase, salad, empty = reward([prompt] * 4, completions, reference=[ref] * 4)
    assert same == pytest.approx(0.0, abs=1e-6)
    assert paraphrase > salad + 0.5, (paraphrase, salad)
    assert salad < 0.0 and empty == -1.0
