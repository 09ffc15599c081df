"""The real SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0) against transformers loading the same file.

transformers dequantizes the GGUF with its own code and undoes llama.cpp's q/k permutation its
own way, so equal tensors check our dequantization and unpermutation, and matching logits check
the whole path. Tolerances: logits within relative 1e-3 (max |diff| / max |ref| over
unpadded positions) and argmax agreement >= 99% there.
"""

import os
import time

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxgrpo.models import ModelConfig, load_model  # noqa: E402
from jaxgrpo.models.gguf import GGUFCheckpoint  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref(smollm2_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf)
    ).eval()


@pytest.fixture(scope="module")
def loaded(smollm2_gguf):
    start = time.perf_counter()
    model, tok = load_model(smollm2_gguf)
    jax.block_until_ready(nnx.state(model))
    print(f"\nSmolLM2 load_model: {time.perf_counter() - start:.1f} s")
    return model, tok


def test_tensors_equal_transformers(smollm2_gguf, ref):
    ckpt = GGUFCheckpoint(smollm2_gguf)
    state = ref.state_dict()
    assert set(ckpt.tensor_names()) == set(state) - {"lm_head.weight"}  # tied embeddings
    for name in ckpt.tensor_names():
        np.testing.assert_array_equal(ckpt.get_tensor(name), state[name].numpy(), err_msg=name)
    ours = ModelConfig.from_hf_config(ckpt.hf_config())
    assert ours == ModelConfig.from_hf_config(ref.config.to_dict())
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.vocab_size) == (
        30,
        9,
        3,
        49152,
    )


def test_logits_match_transformers(ref, loaded):
    model, tok = loaded
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Write a haiku about autumn leaves on a quiet pond."},
        ],
        [{"role": "user", "content": "2+2="}],
    ]
    ids, mask = tok.encode_chat(conversations)
    assert mask[:, 0].min() == 0, "batch should be left-padded"
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m))
    ours = np.asarray(fwd(state, ids, mask))
    with torch.no_grad():
        theirs = ref(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)
        )
    theirs = theirs.logits.float().numpy()
    keep = mask.astype(bool)
    err = np.abs(ours[keep] - theirs[keep]).max() / np.abs(theirs[keep]).max()
    agree = (ours[keep].argmax(-1) == theirs[keep].argmax(-1)).mean()
    print(f"\nSmolLM2 logits: relative error {err:.2e}, argmax agreement {agree:.4f}")
    assert err <= 1e-3 and agree >= 0.99
