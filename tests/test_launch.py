"""Launch scripts' --dry-run output (the exact gcloud commands) and the mesh presets."""

import os
import shlex
import subprocess

import pytest

from jaxgrpo.core import presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_VM = os.path.join(ROOT, "launch", "tpu_vm.sh")
RUN_POD = os.path.join(ROOT, "launch", "run_pod.sh")
BASE = ["--name", "grpo-1", "--zone", "us-central2-b"]


def dry(script: str, *args: str) -> list[list[str]]:
    """The commands a dry run prints, each split as a shell would split it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    out = subprocess.run(
        ["bash", script, "--dry-run", *args], capture_output=True, text=True, env=env, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def remote(cmd: list[str]) -> list[str]:
    """The words of an ssh command's --command, as the worker's shell splits them."""
    (arg,) = [a for a in cmd if a.startswith("--command=")]
    return shlex.split(arg.removeprefix("--command="))


def test_create_tpu_vm_with_runtime_for_the_type():
    (cmd,) = dry(TPU_VM, "create", *BASE, "--type", "v5e-8", "--project", "p1")
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "grpo-1"]
    assert "--accelerator-type=v5litepod-8" in cmd, "v5e-N must become gcloud's v5litepod-N"
    assert "--version=v2-alpha-tpuv5-lite" in cmd
    assert {"--zone=us-central2-b", "--project=p1"} <= set(cmd)


def test_create_queued_spot_and_delete():
    (cmd,) = dry(TPU_VM, "create", *BASE, "--type", "v5p-128", "--queued", "--spot")
    assert cmd[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "grpo-1"]
    assert {"--node-id=grpo-1", "--accelerator-type=v5p-128", "--spot"} <= set(cmd)
    assert "--runtime-version=v2-alpha-tpuv5" in cmd
    (cmd,) = dry(TPU_VM, "delete", *BASE, "--queued")
    assert cmd[3:6] == ["queued-resources", "delete", "grpo-1"] and "--quiet" in cmd
    (cmd,) = dry(TPU_VM, "delete", *BASE)
    assert cmd[3:6] == ["tpu-vm", "delete", "grpo-1"]
    (cmd,) = dry(TPU_VM, "stop", *BASE)
    assert cmd[3:6] == ["tpu-vm", "stop", "grpo-1"]


def test_setup_ships_this_checkout_and_installs_on_every_worker():
    archive, scp, ssh = dry(TPU_VM, "setup", *BASE)
    assert archive[:2] == ["git", "-C"] and archive[2] == ROOT and archive[-1] == "HEAD"
    tarball = archive[archive.index("-o") + 1]
    assert scp[3:5] == ["tpu-vm", "scp"] and scp[5] == tarball and "--worker=all" in scp
    assert ssh[3:6] == ["tpu-vm", "ssh", "grpo-1"] and "--worker=all" in ssh
    words = remote(ssh)
    assert "./jaxgrpo[tpu]" in words and "-e" in words


def test_copy_to_workers_and_to_gcs():
    (cmd,) = dry(TPU_VM, "copy", *BASE, "--src", "data/train.jsonl", "--dst", "data/")
    assert cmd[3:5] == ["tpu-vm", "scp"] and "grpo-1:data/" in cmd and "--worker=all" in cmd
    (cmd,) = dry(TPU_VM, "copy", *BASE, "--src", "runs/a", "--dst", "gs://bucket/runs/a")
    assert cmd == ["gcloud", "storage", "cp", "--recursive", "runs/a", "gs://bucket/runs/a"]


def test_run_pod_starts_train_on_all_workers_and_streams_worker_0():
    args = ["--config", "gsm8k_hard.py", "--config.run_dir=gs://b/runs/with space"]
    start, follow = dry(RUN_POD, *BASE, "--run", "r1", "--env", "WANDB_MODE=offline", "--", *args)
    assert "--worker=all" in start
    words = remote(start)
    i = words.index("-m")
    assert words[i + 1] == "jaxgrpo.train" and words[i + 2 : i + 5] == args
    assert "--config.mesh.num_processes=-1" in words, "pods let jax.distributed discover hosts"
    assert "WANDB_MODE=offline" in words and "nohup" in words
    assert words[words.index(">") + 1] == "logs/r1.log"
    assert "--worker=0" in follow and remote(follow)[-1] == "jaxgrpo/logs/r1.log"


def test_run_pod_keeps_an_explicit_process_count_and_kills_by_pid():
    (start,) = dry(
        RUN_POD, *BASE, "--run", "r2", "--no-follow", "--", "--config.mesh.num_processes=4"
    )
    assert remote(start).count("--config.mesh.num_processes=4") == 1
    assert "--config.mesh.num_processes=-1" not in remote(start)
    (kill,) = dry(RUN_POD, *BASE, "--run", "r2", "--kill")
    assert "cat jaxgrpo/logs/r2.pid" in kill[-1] and "--worker=all" in kill


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        (TPU_VM, ["create", "--zone", "z"], "--name"),
        (TPU_VM, ["frobnicate", *BASE], "unknown argument"),
        (TPU_VM, ["create", *BASE, "--type", "v9-8"], "no default runtime"),
        (RUN_POD, [*BASE], "train arguments"),
        (RUN_POD, [*BASE, "--run", "a b", "--", "--config", "x"], "plain file name"),
    ],
)
def test_scripts_reject_bad_arguments(script, args, message):
    out = subprocess.run(["bash", script, "--dry-run", *args], capture_output=True, text=True)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_preset_meshes_cover_their_devices(name):
    p = presets.PRESETS[name]
    assert p.mesh["data"] * p.mesh["fsdp"] * p.mesh["tensor"] == p.devices
    assert p.devices % p.hosts == 0


def test_preset_flags_validate_against_the_config():
    from jaxgrpo.core.errors import ConfigError
    from jaxgrpo.settings.loading import load_config_dict
    from jaxgrpo.settings.schema import to_train_config

    flags = presets.get_preset("v5litepod-8").flags()
    assert flags == ["--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.tensor=1"]
    cfg = presets.apply_preset(load_config_dict("gsm8k_hard"), "v5e-64")
    train_cfg = to_train_config(cfg, num_devices=64)  # 16 x 8 = 128 rows over 16
    assert train_cfg.mesh.shape() == {"data": 1, "fsdp": 16, "tensor": 4}
    cfg = presets.apply_preset(load_config_dict("gsm8k_hard"), "v5e-256")
    cfg.rl.grad_accum = 4  # 16 x 8 / 4 = 32 rows over 64
    with pytest.raises(ConfigError, match="divisible by mesh data \\* fsdp = 64"):
        to_train_config(cfg, num_devices=256)
    cfg.rl.grad_accum = 2
    to_train_config(cfg, num_devices=256)
    with pytest.raises(KeyError, match="known presets"):
        presets.get_preset("v7-8")
