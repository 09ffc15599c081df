"""`keep_freed_memory`: a freed large buffer is reused by the next allocation, not faulted in again.

Each check runs in a fresh interpreter, because the settings hold for a whole process and must
be made before threads allocate. The allocations happen on a worker thread, as XLA:CPU's do.
"""

import os
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, resource, threading
from jaxgrpo.platform import keep_freed_memory

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

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

PAGES = 2**28 // 4096  # pages in the buffer


def _probe(env_extra: dict) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "JAXGRPO_SYSTEM_MALLOC"} | env_extra
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


def test_freed_buffers_are_reused_without_page_faults():
    applied, faults = _probe({})
    assert applied
    # The third 256 MiB buffer reuses the heap of the first two: a few pages at most fault.
    assert faults < PAGES // 20, f"{faults} page faults for a {PAGES}-page buffer"


def test_opting_out_keeps_the_system_malloc():
    applied, faults = _probe({"JAXGRPO_SYSTEM_MALLOC": "1"})
    assert not applied
    # glibc's default maps and unmaps a buffer this large: every page faults again.
    assert faults > PAGES // 2, f"only {faults} page faults for a {PAGES}-page buffer"
