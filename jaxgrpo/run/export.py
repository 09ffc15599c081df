"""``python -m jaxgrpo.export RUN_DIR OUT_DIR [--peft] [--step N] [--dtype D]``: ship a run.

Rebuilds a training run's model from its ``config.json``, loads the trained parameters of one of
its checkpoints (the latest, or ``--step N``; ``--step 0`` is the model the run started from) and
writes either

- a merged Hugging Face directory (default): LoRA folded into the weights, safetensors, the
  tokenizer and its chat template, for ``transformers.AutoModelForCausalLM`` and the serving
  stacks that read Hugging Face directories; or
- with ``--peft``, the LoRA adapters alone in PEFT's layout, for ``peft.PeftModel`` on top of the
  base model (``--step 0`` writes that base when the run's source is not a Hugging Face one).

The files are written by ``jaxgrpo.models.export``; this module maps a run directory onto it.
Mistakes a user can make (not a run directory, no checkpoint, an unknown step, ``--peft`` on a
full fine-tuning run) print one ``error: ...`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from etils import epath

from jaxgrpo.core.errors import UserError
from jaxgrpo.core.host import prepare_cli
from jaxgrpo.models.aliases import MODEL_ALIASES
from jaxgrpo.models.export import export_hf, export_peft
from jaxgrpo.rl.checkpoint import Checkpointer
from jaxgrpo.run.build import build_mesh, load_policy, restore_params
from jaxgrpo.settings.loading import is_run_dir, run_config


class ExportError(UserError):
    """A mistake in the command line or the run directory, reported as one line."""


def checkpoint_step(ckpt: Checkpointer, run_dir: str, step: int | None) -> int:
    """The step to export: ``step`` if the run saved it, the latest when ``step`` is None.

    Raises:
      ExportError: the run has no checkpoint, or none at ``step`` (the message lists the steps,
        with 0 for the untrained model).
    """
    steps = ckpt.all_steps()
    if not steps:
        raise ExportError(f"no checkpoint in {run_dir}/checkpoints: the run saved none yet")
    if step is None:
        return max(steps)
    if step not in steps:
        listed = ", ".join(str(s) for s in [0, *sorted(steps)])
        raise ExportError(f"no checkpoint for step {step} in {run_dir}; available: {listed}")
    return step


def hf_base(source: str) -> str | None:
    """``source`` as a ``from_pretrained`` argument (local directory or hub id), or None when
    it is not a Hugging Face checkpoint (a GGUF file, an alias, a run directory)."""
    if source in MODEL_ALIASES or source.endswith(".gguf") or is_run_dir(source):
        return None
    return os.path.abspath(source) if os.path.isdir(source) else source


def run_config_of(run_dir: str, peft: bool = False) -> Any:
    """The ``TrainConfig`` of run ``run_dir``, checked for an export (``peft``: adapters only).

    Raises:
      ExportError: ``run_dir`` has no config.json; ``peft`` on a full fine-tuning run.
    """
    if not (epath.Path(run_dir) / "config.json").exists():
        raise ExportError(
            f"{run_dir} is not a jaxgrpo run directory (no config.json; "
            "python -m jaxgrpo.train --config ... writes one in its run_dir)"
        )
    cfg = run_config(None, run_dir, {})
    if peft and cfg.model.lora_rank == 0:
        raise ExportError(
            f"--peft exports LoRA adapters, but {run_dir} is a full fine-tuning run "
            "(model.lora_rank = 0); drop --peft to export the merged model"
        )
    return cfg


def trained_model(cfg: Any, run_dir: str, step: int | None) -> tuple[Any, Any, int]:
    """(model, tokenizer, step): the run's model with checkpoint ``step``'s parameters (None:
    the latest; 0: the model as built, untrained)."""
    mesh = build_mesh(cfg)
    if step == 0:
        model, tokenizer, _ = load_policy(cfg, None, mesh)
        return model, tokenizer, 0
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not epath.Path(ckpt_dir).exists():  # checked first: the Checkpointer would create it
        raise ExportError(f"no checkpoint in {ckpt_dir}: the run saved none yet")
    ckpt = Checkpointer(ckpt_dir, every=0, keep=cfg.checkpoint.keep)
    try:
        step = checkpoint_step(ckpt, run_dir, step)
    finally:
        ckpt.close()
    model, tokenizer, _ = load_policy(cfg, None, mesh)
    restore_params(cfg, model, tokenizer, run_dir, mesh, step)
    return model, tokenizer, step


def export_run(
    run_dir: str, out_dir: str, *, peft: bool = False, step: int | None = None, dtype=None
) -> tuple[str, int, Any]:
    """Writes run ``run_dir``'s model at ``step`` (default: latest) to ``out_dir``.

    Args:
      run_dir: a directory written by ``python -m jaxgrpo.train``.
      out_dir: destination; replaced atomically if it exists.
      peft: write the LoRA adapters alone (PEFT layout) instead of the merged model.
      step: checkpoint step; 0 = the untrained model; None = the latest.
      dtype: stored weight dtype of the merged model ("float32" or "bfloat16"; default: the
        model's parameter dtype).

    Returns:
      (absolute output path, the exported step, the run's ``TrainConfig``).

    Raises:
      ExportError: see ``run_config_of`` and ``checkpoint_step``.
    """
    cfg = run_config_of(run_dir, peft)
    model, tokenizer, step = trained_model(cfg, run_dir, step)
    if peft:
        path = export_peft(model, out_dir, hf_base(cfg.model.source) or "")
    else:
        path = export_hf(model, tokenizer, out_dir, dtype=dtype)
    return path, step, cfg


def load_instructions(path: str, run_dir: str, peft: bool, source: str) -> str:
    """The lines telling the user how to load what was written to ``path``."""
    if not peft:
        return (
            "load it with:\n"
            "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"  model = AutoModelForCausalLM.from_pretrained({path!r})\n"
            f"  tokenizer = AutoTokenizer.from_pretrained({path!r})"
        )
    base = hf_base(source)
    lines = [
        "load it with:",
        "  from peft import PeftModel",
        "  from transformers import AutoModelForCausalLM",
        f"  base = AutoModelForCausalLM.from_pretrained({base or 'BASE_DIR'!r})",
        f"  model = PeftModel.from_pretrained(base, {path!r})",
    ]
    if base is None:
        lines.append(
            f"BASE_DIR: the run's base model ({source}) as a Hugging Face directory, written by"
            f"\n  python -m jaxgrpo.export {run_dir} BASE_DIR --step 0"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line (argparse exits with status 2 on a malformed one)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxgrpo.export",
        description="Export a training run's checkpoint as a merged Hugging Face model "
        "(default) or as LoRA adapters in PEFT layout (--peft).",
    )
    p.add_argument("run_dir", help="training run directory (config.json, checkpoints/)")
    p.add_argument("out_dir", help="output directory (replaced if it exists)")
    p.add_argument("--peft", action="store_true", help="write the LoRA adapters alone (PEFT)")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest; 0 = untrained)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="stored weight dtype (merged model only)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: export, then print the output path and how to load it."""
    prepare_cli()
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    run_dir = args.run_dir.rstrip("/") or args.run_dir
    try:
        path, step, cfg = export_run(
            run_dir, args.out_dir, peft=args.peft, step=args.step, dtype=args.dtype
        )
    except (UserError, OSError) as e:  # ExportError, ConfigError, a malformed run directory
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "LoRA adapters (PEFT layout)" if args.peft else "merged Hugging Face model"
    print(f"wrote {path}: {what}, step {step} of {run_dir}")
    print(load_instructions(path, run_dir, args.peft, cfg.model.source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
