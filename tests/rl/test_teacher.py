"""A frozen teacher in the step: its log-probs, the distillation term and the KL aimed at it.

The policy is the random tiny model; the teacher is a random Llama built by ``transformers``
(saved, then loaded as any HF directory), or the policy's own base weights. Tolerances:
log-probs against transformers 1e-4 (float32, relative to their scale); parameters after a
step on 8 devices against 1 device 1e-5 absolute, as tests/rl/test_learner.py.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from learner_helpers import host_params, make_learner, train_tiny_run
from tiny_hf import llama_config

from jaxgrpo.core.errors import ConfigError
from jaxgrpo.core.sharding import to_host
from jaxgrpo.models import load_model
from jaxgrpo.models.config import LoRAConfig
from jaxgrpo.models.tiny import TINY_VOCAB, tiny_model, tiny_tokenizer
from jaxgrpo.rewards import RewardSet
from jaxgrpo.rl.step_metrics import Timer
from jaxgrpo.run import train
from jaxgrpo.settings.loading import load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DISTIL = {"teacher.source": "hf-teacher", "teacher.distill_coef": 1.0}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A random transformers Llama with the tiny tokenizer's vocabulary, saved as HF files."""
    path = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(vocab_size=TINY_VOCAB))
    model.save_pretrained(path)
    return path


def _hf_teacher(teacher_dir):
    def build(mesh, layout):
        return load_model(teacher_dir, tokenizer=tiny_tokenizer(), mesh=mesh, layout=layout)[0]

    return build


def _batch(learner, examples):
    """(rollout, device batch, host extras) of one step's collect and prepare."""
    state = learner.init_state()
    _, _, k_sample, _ = learner.programs.advance(state.step, state.rng)
    rollout, _ = learner.collect(state.params, examples, k_sample, 0, None, Timer())
    batch, extra = learner.prepare(state, rollout)
    return rollout, batch, extra


def _hf_logprobs(teacher_dir, rollout, t: int) -> np.ndarray:
    """log p(token) of every completion token under transformers' forward, row by row with no
    padding (the prompt's real ids, then the completion's)."""
    hf = transformers.LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    g = rollout.group_size
    out = np.zeros((rollout.tokens.shape[0], t))
    for r in range(rollout.tokens.shape[0]):
        prompt = rollout.prompt_ids[r // g][rollout.prompt_mask[r // g] > 0]
        n = int(rollout.mask[r].sum())
        ids = np.concatenate([prompt, rollout.tokens[r, :n]])
        with torch.no_grad():
            logits = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].double()
        logp = torch.log_softmax(logits / float(rollout.temps[r, 0]), dim=-1)
        rows = torch.arange(len(prompt) - 1, len(ids) - 1)
        out[r, :n] = logp[rows, torch.tensor(ids[len(prompt) :])].numpy()
    return out


@pytest.fixture(scope="module")
def distilled(teacher_dir):
    """One device, a teacher from HF files, the distillation term on."""
    learner, task = make_learner(
        {"data": 1}, jax.devices()[:1], teacher=_hf_teacher(teacher_dir), **DISTIL
    )
    examples = list(task.train_examples(0))[:2]
    return learner, examples


def test_teacher_logprobs_equal_a_transformers_forward(distilled, teacher_dir):
    learner, examples = distilled
    rollout, batch, _ = _batch(learner, examples)
    got = to_host(batch.teacher_logp)
    mask = rollout.mask[:, : got.shape[1]] > 0
    want = _hf_logprobs(teacher_dir, rollout, got.shape[1])
    scale = np.abs(want[mask]).max()
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-4, atol=1e-4 * scale)


def test_a_distillation_step_reports_the_teacher_and_trains(distilled):
    learner, examples = distilled
    state = learner.init_state()
    before = host_params(state)
    state, m, _ = learner.step(state, examples)
    for key in (
        "teacher/reverse_kl",
        "teacher/reverse_kl_correct",
        "teacher/reverse_kl_incorrect",
        "distill_reverse_kl",
        "time/teacher",
    ):
        assert key in m, key
    # The update's reverse KL (behaviour = this pass) equals the host's (the sampler's).
    assert m["distill_reverse_kl"] == pytest.approx(m["teacher/reverse_kl"], rel=1e-4)
    assert m["teacher/reverse_kl"] > 0.1, "a random teacher is far from the policy"
    assert m["time/teacher"] > 0 and m["grad_norm"] > 0
    moved = max(np.abs(a - b).max() for a, b in zip(before, host_params(state), strict=True))
    assert moved > 0


def test_the_policys_own_base_weights_as_teacher_give_zero_reverse_kl():
    """A teacher built as the policy is (same seed, adapters with B = 0) scores every token as
    the sampler did: the distillation term is 0 token by token."""

    def same_base(mesh, layout):
        return tiny_model(LoRAConfig(rank=4, alpha=8.0), seed=0, mesh=mesh, layout=layout)[0]

    learner, task = make_learner({"data": 1}, jax.devices()[:1], teacher=same_base, **DISTIL)
    rollout, batch, extra = _batch(learner, list(task.train_examples(0))[:2])
    mask = rollout.trained_mask[:, : batch.teacher_logp.shape[1]] > 0
    gap = np.abs(to_host(batch.teacher_logp) - rollout.logprobs[:, : mask.shape[1]])[mask]
    assert gap.max() < 1e-4
    assert abs(extra["teacher"]["teacher/reverse_kl"]) < 1e-5


def test_kl_toward_the_teacher_replaces_the_reference(teacher_dir):
    learner, task = make_learner(
        {"data": 1},
        jax.devices()[:1],
        teacher=_hf_teacher(teacher_dir),
        **{"teacher.source": "hf-teacher", "teacher.as_reference": True},
    )
    p = learner.programs
    assert not p.needs_ref and p.kl_to_teacher and not p.objective.use_teacher_logp
    state = learner.init_state()
    assert state.ref_params is None, "no reference copy is kept when the teacher replaces it"
    rollout, batch, extra = _batch(learner, list(task.train_examples(0))[:2])
    assert batch.teacher_logp is None
    mask = rollout.mask[:, : batch.ref_logp.shape[1]] > 0
    want = _hf_logprobs(teacher_dir, rollout, batch.ref_logp.shape[1])
    np.testing.assert_allclose(to_host(batch.ref_logp)[mask], want[mask], rtol=1e-4, atol=1e-4)
    _, m, _ = learner.step(learner.init_state(), list(task.train_examples(0))[:2])
    assert m["kl/mean"] > 0.01, "the KL to a random teacher is not the reference's 0"


def test_eight_devices_equal_one_with_a_teacher(distilled, teacher_dir):
    learner, examples = distilled
    state, m1, _ = learner.step(learner.init_state(), examples)
    eight, _ = make_learner(
        {"data": 2, "fsdp": 2, "tensor": 2},
        jax.devices(),
        teacher=_hf_teacher(teacher_dir),
        **DISTIL,
    )
    state8, m8, _ = eight.step(eight.init_state(), examples)
    for got, want in zip(host_params(state8), host_params(state), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for key in ("teacher/reverse_kl", "loss", "grad_norm"):
        assert m8[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key


def test_a_run_directory_distils_through_the_training_entry_point(tmp_path):
    """`teacher.source` names a trained run: its checkpoint (LoRA merged) is the teacher, the
    header says so, and the metrics rows carry the teacher's figures."""
    teacher_run = train_tiny_run(str(tmp_path / "teacher"), steps=1)
    over = {
        "run_dir": str(tmp_path / "student"),
        "steps": 1,
        "logging.tensorboard": False,
        "teacher.source": teacher_run,
        "teacher.distill_coef": 1.0,
    }
    train.run(load_config("tiny", over))
    rows = [json.loads(x) for x in open(tmp_path / "student" / "metrics.jsonl")]
    step = next(r for r in rows if "teacher/reverse_kl" in r)
    assert np.isfinite(step["teacher/reverse_kl"]) and step["time/teacher"] > 0


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    """The tiny policy's 384-id tokenizer against SmolLM2's: one line naming both sources."""
    cmd = [
        sys.executable, "-m", "jaxgrpo.train", "--config", "tiny.py",
        f"--config.run_dir={tmp_path / 'run'}", "--config.steps=1",
        "--config.teacher.source=smollm2", "--config.teacher.distill_coef=1.0",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    err = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "teacher.source" in err[0], out.stderr[-2000:]
    assert "'smollm2'" in err[0] and "'tiny'" in err[0]
    assert "Traceback" not in out.stderr


def test_no_reward_at_all_is_a_distillation_run():
    """`rewards.functions = ()` is refused unless a teacher's term is the signal; a reward set
    of no functions scores every sample 0."""
    with pytest.raises(ConfigError, match="rewards.functions"):
        load_config("tiny", {"rewards.functions": ()})
    cfg = load_config("tiny", {"rewards.functions": (), **DISTIL})
    assert cfg.rewards.functions == ()
    total, per_fn, weights = RewardSet([])(["p"] * 3, ["c"] * 3)
    assert total.tolist() == [0.0, 0.0, 0.0] and per_fn == {} and weights == {}
