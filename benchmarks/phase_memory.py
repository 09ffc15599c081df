"""Which phase of a jaxgrpo GRPO step sets its peak memory: RSS peak per phase.

`grpo_step.py` reports one peak per run (`ru_maxrss`). This runs jaxgrpo's side of the same
workload (`grpo_step.jaxgrpo_config`) through `Learner.step`, samples the process's resident
memory every 5 ms on a thread, and prints the peak of each phase of each step: sampling
(`collect`), the reference pass (`prepare`), the update (`optimize`), and the gaps between
them. Step 0 compiles.

    python benchmarks/phase_memory.py --task gsm8k --new-tokens 512 --variant full

Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpo_step  # noqa: E402  (this folder's workload definitions)

PHASES = {"collect": "sampling", "prepare": "reference", "optimize": "update"}


class PhasePeaks:
    """The peak RSS of each labelled phase, sampled from /proc/self/statm on a thread."""

    def __init__(self, period_s: float = 0.005):
        self.label, self.peaks, self.period_s = "setup", {}, period_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            with open("/proc/self/statm", encoding="ascii") as f:
                rss = int(f.read().split()[1]) * self.page
            label = self.label
            self.peaks[label] = max(self.peaks.get(label, 0), rss)
            time.sleep(self.period_s)

    def wrap(self, obj, name: str, label: str) -> None:
        """Labels the calls of `obj.name` as `label` (and what follows them as after it)."""
        method = getattr(obj, name)

        def labelled(*args, **kwargs):
            self.label = label
            try:
                return method(*args, **kwargs)
            finally:
                self.label = f"after {label}"

        setattr(obj, name, labelled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="gsm8k", choices=["format_copy", "gsm8k"])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--model", default="smollm2", choices=sorted(grpo_step.MODELS))
    parser.add_argument("--variant", default="full", choices=["lora", "full"])
    parser.add_argument("--steps", type=int, default=2, help="steps, the compiling one included")
    args = parser.parse_args()

    from jaxgrpo.core.host import keep_freed_memory, use_cpu_xla_flags
    from jaxgrpo.run.build import build_parts

    use_cpu_xla_flags()
    keep_freed_memory()
    peaks = PhasePeaks()
    name = f"{args.model.replace(':', '_').replace('.', '')}_hf"
    hf_dir = grpo_step.export_model(args.model, os.path.join(tempfile.gettempdir(), name))
    w = grpo_step.Workload(args.model, args.task, args.new_tokens, steps=1, hf_dir=hf_dir)
    learner = build_parts(grpo_step.jaxgrpo_config(w, args.variant == "lora")).learner
    state = learner.init_state()
    examples = grpo_step.examples(w.task, w.prompts)
    for step in range(args.steps):
        for method, phase in PHASES.items():
            peaks.wrap(learner, method, f"step {step} {phase}")
        state, _, _ = learner.step(state, examples)
        time.sleep(0.05)  # let the sampler see the step's end
        for method in PHASES:
            delattr(learner, method)  # back to the class's method, wrapped again next step
    for label, rss in peaks.peaks.items():
        print(f"{label:24s} {rss / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main()
