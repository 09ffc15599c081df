"""GGUF reading on tiny files written here the way llama.cpp's converter writes them.

Each file comes from a random tiny transformers model: hyperparameters as `{arch}.*` metadata,
q/k rows permuted for the Llama architecture (llama.cpp's `permute`, re-implemented below from
its definition), Llama 3 RoPE scaling as a `rope_freqs` tensor of per-frequency divisors
(derived from transformers' own inverse frequencies), and the tokenizer as `tokenizer.ggml.*`.
Logits parity tolerance as in test_load_export: relative 1e-4 and identical argmax.
"""

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from test_load_export import ARCHS, assert_parity, batch, ours, theirs, tiny_hf_tokenizer  # noqa: E402

from jaxgrpo.models import ModelConfig, load_model  # noqa: E402
from jaxgrpo.models.gguf import GGUFCheckpoint, gguf_to_hf_name  # noqa: E402

Q = gguf.GGMLQuantizationType
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name):
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{HF_TO_GGUF[rest]}"


def llama_cpp_permute(w, n_heads):
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def rope_divisors(config):
    """Per-frequency divisors of Llama 3 scaling: unscaled / scaled inverse frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).float().numpy()


def write_gguf(path, ref, arch, *, qtypes=None, drop=(), arch_name=None):
    """Write `ref` (a transformers model) and the tiny tokenizer as a llama.cpp-style GGUF."""
    c = ref.config
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_key_length(c.head_dim)
    tok = json.loads(tiny_hf_tokenizer().backend_tokenizer.to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {a["content"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(tok["model"]["vocab"]["<|im_end|>"])
    w.add_pad_token_id(tok["model"]["vocab"]["<|endoftext|>"])
    w.add_chat_template(tiny_hf_tokenizer().chat_template)
    for name, t in ref.state_dict().items():
        if name in drop or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        x = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            x = llama_cpp_permute(x, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            x = llama_cpp_permute(x, c.num_key_value_heads)
        qtype = (qtypes or {}).get(name, Q.F32)
        if qtype in (Q.F32, Q.F16):  # the writer infers these from the numpy dtype
            w.add_tensor(gguf_name(name), quantize(x, qtype))
        else:  # byte rows; the writer derives the element shape from raw_dtype
            w.add_tensor(gguf_name(name), quantize(x, qtype), raw_dtype=qtype)
    if getattr(c, "rope_parameters", {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", rope_divisors(c))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def refs():
    out = {}
    for arch in ("llama", "qwen3"):
        torch.manual_seed(0)
        out[arch] = transformers.AutoModelForCausalLM.from_config(ARCHS[arch]()).eval()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_gguf_tensors_config_and_logits(refs, tmp_path, arch):
    ref = refs[arch]
    path = write_gguf(tmp_path / f"{arch}.gguf", ref, arch)
    ckpt = GGUFCheckpoint(path)
    expected = {k: v.numpy() for k, v in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert sorted(ckpt.tensor_names()) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(ckpt.get_tensor(name), value, err_msg=name)
    ours_cfg = ModelConfig.from_hf_config(ckpt.hf_config())
    # GGUF stores the norm epsilon as float32.
    assert ours_cfg.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)
    ref_cfg = ModelConfig.from_hf_config(ref.config.to_dict())
    assert ours_cfg == ref_cfg.replace(rms_norm_eps=ours_cfg.rms_norm_eps)
    if arch == "llama":
        assert dict(ours_cfg.rope_scaling)["factor"] == 8.0
    model, tok = load_model(path)
    ids, mask = batch(tok)
    assert_parity(ours(model, ids, mask), theirs(ref, ids, mask), mask)


def test_quantized_tensors_dequantize_like_gguf(refs, tmp_path):
    """Q8_0/Q4_0/Q4_1 match gguf's reference dequantizer exactly; F16/BF16 round like numpy."""
    ref = refs["qwen3"]
    names = {
        "model.layers.0.mlp.up_proj.weight": Q.Q8_0,
        "model.layers.0.mlp.down_proj.weight": Q.Q4_0,
        "model.layers.1.self_attn.q_proj.weight": Q.Q4_1,
        "model.layers.1.mlp.gate_proj.weight": Q.F16,
        "model.layers.1.self_attn.o_proj.weight": Q.BF16,
    }
    ckpt = GGUFCheckpoint(write_gguf(tmp_path / "q.gguf", ref, "qwen3", qtypes=names))
    sd = ref.state_dict()
    for name, qtype in names.items():
        x = sd[name].numpy()
        got = ckpt.get_tensor(name)
        assert got.dtype == np.float32 and got.shape == x.shape
        if qtype == Q.F16:
            np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
        elif qtype == Q.BF16:
            np.testing.assert_array_equal(got, torch.tensor(x).bfloat16().float().numpy())
        else:
            np.testing.assert_array_equal(got, gguf_dequantize(quantize(x, qtype), qtype))
            # 8-bit (4-bit) blocks of 32 keep each value within 1/127 (1/7) of the block's max.
            tol = (1 / 127 if qtype == Q.Q8_0 else 1 / 7) * np.abs(x).max()
            np.testing.assert_allclose(got, x, atol=tol)


def test_name_map_covers_llama_cpp_names():
    assert gguf_to_hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_gguf_errors_name_the_problem(refs, tmp_path):
    ref = refs["qwen3"]
    with pytest.raises(ValueError, match=r"Unsupported architecture 'gpt2'.*llama, qwen2, qwen3"):
        GGUFCheckpoint(write_gguf(tmp_path / "a.gguf", ref, "qwen3", arch_name="gpt2"))
    drop = "model.layers.1.mlp.up_proj.weight"
    path = write_gguf(tmp_path / "m.gguf", ref, "qwen3", drop=(drop,))
    with pytest.raises(KeyError, match=rf"Missing tensor '{drop}'"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "absent.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFCheckpoint(tmp_path / "bad.gguf")
