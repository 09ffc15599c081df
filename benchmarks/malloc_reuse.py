"""Page faults of a reused 256 MiB buffer, with `keep_freed_memory` and with the system malloc.

`jaxgrpo.core.host.keep_freed_memory()` keeps glibc from unmapping freed large buffers, so the
next allocation of the same size reuses them instead of faulting every page in again (the
cause is in benchmarks/README.md, "Keeping freed memory"). This prints, for each setting,
whether the settings applied and the minor page faults of the third malloc-write-free of a 256 MiB
buffer on a worker thread (as XLA:CPU allocates), against the buffer's page count:

    python benchmarks/malloc_reuse.py

Expected on glibc: a few pages at most with the settings; about every page with
`JAXGRPO_SYSTEM_MALLOC=1` (glibc maps and unmaps a buffer this large). Each setting runs in a
fresh interpreter, because it holds for a whole process and must be made before threads
allocate. Linux with glibc only.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import ctypes, resource, threading
from jaxgrpo.core.host import keep_freed_memory

applied = keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []

def work():  # plain malloc, write, free: what XLA:CPU does with a buffer (numpy would madvise)
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buf = libc.malloc(2**28)  # 256 MiB
        ctypes.memset(buf, 1, 2**28)
        libc.free(buf)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

t = threading.Thread(target=work)
t.start()
t.join()
print(applied, faults[-1])
"""

PAGES = 2**28 // 4096  # pages in the buffer


def probe(env_extra: dict) -> tuple[bool, int]:
    """(settings applied, page faults of the third buffer) in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "JAXGRPO_SYSTEM_MALLOC"} | env_extra
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


def main() -> None:
    if not sys.platform.startswith("linux"):
        sys.exit("glibc malloc only: run on Linux")
    print(f"{'setting':<28} {'applied':>7} {'page faults':>12} {'of pages':>9}")
    for name, env in (
        ("keep_freed_memory", {}),
        ("JAXGRPO_SYSTEM_MALLOC=1", {"JAXGRPO_SYSTEM_MALLOC": "1"}),
    ):
        applied, faults = probe(env)
        print(f"{name:<28} {applied!s:>7} {faults:>12} {PAGES:>9}")


if __name__ == "__main__":
    main()
