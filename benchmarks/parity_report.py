"""Prints max|diff|/max|ref| and argmax agreement of jaxgrpo's logits against transformers.

Tiny random Llama (llama3 rope), Qwen2 (tied, qkv bias) and Qwen3 (qk norm) models, float32, a
left-padded batch of three rows. The tests assert the tolerance; this script reports the figure.
Run: ``python benchmarks/parity_report.py``.
"""

import os
import sys

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.construct import random_model
from jaxgrpo.models.weights import load_hf_tensors

# The tests' tiny configs (tests/tiny_hf.py), with HF's own initializer range and no special
# token ids, so the figures stay comparable with earlier reports.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from tiny_hf import llama_config, qwen2_config, qwen3_config  # noqa: E402

_PLAIN = dict(initializer_range=0.02, pad_token_id=None, bos_token_id=None, eos_token_id=None)
CONFIGS = {
    "llama (llama3 rope)": lambda: llama_config(**_PLAIN),
    "qwen2 (tied, qkv bias)": lambda: qwen2_config(**_PLAIN),
    "qwen3 (qk norm)": lambda: qwen3_config(**_PLAIN),
}


def main():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, size=(3, 24))
    mask = np.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :15] = 0
    ids = ids * mask
    valid = mask.astype(bool)
    for name, make in CONFIGS.items():
        hf = make()
        torch.manual_seed(0)
        ref_model = transformers.AutoModelForCausalLM.from_config(hf).eval()
        sd = ref_model.state_dict()
        model = random_model(ModelConfig.from_hf_config(hf.to_dict()), seed=0)
        load_hf_tensors(model, lambda n, sd=sd: sd[n].detach().numpy())
        ours = np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)))
        with torch.no_grad():
            ref = ref_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
        ref = ref.numpy()
        rel = np.abs(ours[valid] - ref[valid]).max() / np.abs(ref[valid]).max()
        agree = (ours[valid].argmax(-1) == ref[valid].argmax(-1)).mean()
        print(f"{name:24s} max|diff|/max|ref| = {rel:.2e}  argmax agreement {agree:.3f}")


if __name__ == "__main__":
    main()
