"""load_model on tiny Hugging Face directories, export round trips (transformers, PEFT), errors.

Parity tolerance: float32 logits within max|ours - torch| <= 1e-4 * max|torch| on unpadded
positions, and identical argmax there (random weights with initializer_range 0.3 keep logits
peaked enough that rounding cannot flip an argmax).
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_hf import ARCHS as TINY_HF_ARCHS  # noqa: E402

from jaxgrpo.core.presets import ARCHITECTURES  # noqa: E402
from jaxgrpo.models import SafetensorsFiles, load_model, random_model  # noqa: E402
from jaxgrpo.models.config import ModelConfig  # noqa: E402
from jaxgrpo.models.export import export_hf, export_peft, save_safetensors  # noqa: E402
from jaxgrpo.models.tiny import tiny_tokenizer  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The shared tiny configs with a vocabulary the tokenizer below fills (320), and a float32-exact
# epsilon that survives GGUF's float32 metadata, so GGUF- and directory-loaded models share one
# ModelConfig and one compiled forward.
VARIANT = dict(vocab_size=320, rms_norm_eps=2.0**-20)
ARCHS = {arch: functools.partial(build, **VARIANT) for arch, build in TINY_HF_ARCHS.items()}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "o", "up", "down"]}
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c", "hi"]


def tiny_hf_tokenizer():
    """A ~300-token byte-level BPE with ChatML specials, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(TEXTS * 10, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def write_hf_dir(path, arch, max_shard_size=None, seed=0):
    """save_pretrained of a random tiny model plus the tiny tokenizer; returns the torch model."""
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(ARCHS[arch]()).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    ref.save_pretrained(path, **kwargs)
    tiny_hf_tokenizer().save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{arch: (dir, torch model)}; llama is sharded (several safetensors plus an index)."""
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        out[arch] = (path, write_hf_dir(path, arch, "40KB" if arch == "llama" else None))
    return out


def batch(tokenizer):
    conversations = [[{"role": "user", "content": t}] for t in TEXTS[:3]]
    return tokenizer.encode_chat(conversations, min_bucket=8)


@functools.cache
def _forward(graphdef):
    """One jitted forward per model structure, so equal configs compile once."""
    return jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, attention_mask=mask))


def ours(model, ids, mask):
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef)(state, ids, mask))


def theirs(ref, ids, mask):
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def assert_parity(a, b, mask, rtol=1e-4):
    keep = mask.astype(bool)
    err = np.abs(a[keep] - b[keep]).max() / np.abs(b[keep]).max()
    assert err <= rtol, f"relative logits error {err:.2e} > {rtol}"
    np.testing.assert_array_equal(a[keep].argmax(-1), b[keep].argmax(-1))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_dir_logits_match_torch(dirs, arch):
    path, ref = dirs[arch]
    if arch == "llama":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model, tok = load_model(path)
    assert model.cfg.arch == arch and tok.vocab_size == 300
    ids, mask = batch(tok)
    p = ids.shape[1]
    assert p & (p - 1) == 0 and mask[:, 0].min() == 0, "expected a left-padded pow2 bucket"
    assert_parity(ours(model, ids, mask), theirs(ref, ids, mask), mask)


def test_mesh_load_is_sharded_and_equal(dirs):
    """Loading onto an 8-device mesh puts each tensor in its sharding with the same values."""
    from jaxgrpo.core.sharding import make_mesh

    path, _ = dirs["llama"]
    sharded, _ = load_model(path, mesh=make_mesh({"data": 1, "fsdp": 4, "tensor": 2}))
    plain, _ = load_model(path)
    q = sharded.layers.attn.q.kernel[...]
    assert not q.sharding.is_fully_replicated and len(q.sharding.device_set) == 8
    for a, b in zip(*(jax.tree.leaves(nnx.state(m)) for m in (sharded, plain)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_PEAK_SCRIPT = """
import sys
import jax
from flax import nnx
from jaxgrpo.models import load_model
from jaxgrpo.models.tokenizer import Tokenizer
from jaxgrpo.core.sharding import make_mesh

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}) if sys.argv[2] == "mesh" else None
jax.devices()  # the runtime and the tokenizer (transformers' imports) are not the load's
tokenizer = Tokenizer.from_pretrained(sys.argv[1])
before = status("VmRSS")
model, _ = load_model(sys.argv[1], mesh=mesh, tokenizer=tokenizer)
jax.block_until_ready(nnx.state(model))
print(before, status("VmHWM"))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
@pytest.mark.parametrize("placement", ["mesh", "host"])
def test_load_holds_one_copy_of_the_weights(tmp_path, placement):
    """A load's peak resident memory grows by the weights' bytes and one tensor being read, at
    most 1.25x the checkpoint: no zero arrays placed first (a CPU device writes them out), no
    memory-mapped file pages held, and no copy when a filled host array is placed."""
    # SmolLM2-135M's layers, 16 of them, and a small vocabulary: 234 MiB, no tensor above 8%.
    shape = dict(ARCHITECTURES["SmolLM2-135M"], num_hidden_layers=16, vocab_size=8192)
    export_hf(random_model(ModelConfig.from_hf_config(shape)), tiny_tokenizer(), tmp_path)
    size = os.path.getsize(tmp_path / "model.safetensors")
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path), placement],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, peak = map(int, out.stdout.split())
    grown = (peak - before) / size
    print(f"{placement}: the peak grew by {grown:.2f}x the checkpoint's {size} bytes")
    assert grown <= 1.25, f"loading {size / 2**20:.0f} MiB grew the peak by {grown:.2f}x of it"


def _random_lora_b(model, seed=1):
    """Give every adapter a non-zero B so LoRA changes the logits (numpy draws: each distinct
    shape of a jax.random draw would cost an XLA compilation)."""
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(
        model, jax.tree.map(lambda x: 0.05 * rng.standard_normal(x.shape, np.float32), state)
    )


def test_export_hf_round_trip_merges_lora(dirs, tmp_path):
    path, ref = dirs["llama"]
    model, tok = load_model(path, lora=LORA)
    _random_lora_b(model)
    ids, mask = batch(tok)
    expected = ours(model, ids, mask)
    assert np.abs(expected - theirs(ref, ids, mask)).max() > 1e-2, "LoRA B should move logits"
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("replaced atomically")
    export_hf(model, tok, out, max_shard_bytes=60_000)
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors.index.json").exists()
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert_parity(expected, theirs(exported, ids, mask), mask)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    conversation = [{"role": "user", "content": TEXTS[1]}]
    assert hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(conversation)
    )
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(tok.eos_ids)


def test_export_bfloat16_loads_back(dirs, tmp_path):
    path, _ = dirs["qwen2"]
    model, tok = load_model(path)
    out = export_hf(model, tok, tmp_path / "bf16", dtype="bfloat16")
    names = SafetensorsFiles([os.path.join(out, "model.safetensors")])
    assert names.get_tensor("model.embed_tokens.weight").dtype.name == "bfloat16"
    back, _ = load_model(out)
    ids, mask = batch(tok)
    # bfloat16 keeps 8 mantissa bits: weights move by <= 2^-8 relative.
    assert_parity(ours(back, ids, mask), ours(model, ids, mask), mask, rtol=5e-2)


def test_export_peft_loads_in_peft(dirs, tmp_path):
    peft = pytest.importorskip("peft")
    path, _ = dirs["llama"]  # same structure as the export test: its forward is compiled once
    model, tok = load_model(path, lora=LORA)
    _random_lora_b(model)
    out = export_peft(model, tmp_path / "adapter", base_model_name_or_path=path)
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    peft_model = peft.PeftModel.from_pretrained(base, out).eval()
    ids, mask = batch(tok)
    assert_parity(ours(model, ids, mask), theirs(peft_model, ids, mask), mask)


def _copy_with(src, dst, *, drop=None, reshape=None, config=None):
    """Copy a single-file HF dir, dropping/reshaping one tensor or patching config.json."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads(open(os.path.join(dst, "config.json")).read())
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**cfg, **config}, f)
    if drop or reshape:
        weights = os.path.join(dst, "model.safetensors")
        files = SafetensorsFiles([weights])
        tensors = {n: np.array(files.get_tensor(n)) for n in files.names() if n != drop}
        if reshape:
            tensors[reshape] = tensors[reshape][:-1]
        del files
        save_safetensors(tensors, weights)
    return str(dst)


def test_errors_name_the_problem(dirs, tmp_path):
    path, _ = dirs["qwen3"]
    proj = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"Unsupported architecture 'gpt2'.*llama, qwen2, qwen3"):
        load_model(_copy_with(path, tmp_path / "arch", config={"model_type": "gpt2"}))
    with pytest.raises(KeyError, match=rf"Missing tensor '{proj}' \(expected shape \(128, 64\)\)"):
        load_model(_copy_with(path, tmp_path / "missing", drop=proj))
    with pytest.raises(ValueError, match=rf"'{proj}' has shape \(127, 64\), expected \(128, 64\)"):
        load_model(_copy_with(path, tmp_path / "shape", reshape=proj))
    with pytest.raises(ValueError, match=r"Tokenizer vocabulary \(300 tokens\).*\(256 rows\)"):
        load_model(_copy_with(path, tmp_path / "vocab", config={"vocab_size": 256}))
    with pytest.raises(FileNotFoundError, match="Model source not found"):
        load_model(str(tmp_path / "nowhere"))
    os.remove(os.path.join(_copy_with(path, tmp_path / "noconf"), "config.json"))
    with pytest.raises(FileNotFoundError, match="No config.json"):
        load_model(str(tmp_path / "noconf"))


def test_hub_id_offline_raises_clearly(monkeypatch):
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # never touch the network
    with pytest.raises(OSError, match="'org/model' is not a local path and could not be fetched"):
        load_model("org/model")


def test_export_cli_converts_a_source(dirs, tmp_path, capsys):
    from jaxgrpo.models.export import main

    path, ref = dirs["qwen2"]
    main([path, str(tmp_path / "cli")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    exported = SafetensorsFiles([str(tmp_path / "cli" / "model.safetensors")])
    for name, value in ref.state_dict().items():
        if name != "lm_head.weight":  # tied
            np.testing.assert_array_equal(exported.get_tensor(name), value.numpy(), err_msg=name)
