"""Kernels in C, built on the machine at hand: compiled once per source and compiler, then loaded.

A kernel whose arithmetic order the code must fix (tpserve/kernels/native/attention.c) is plain C with no
torch headers, so building it takes about a second with the system's C compiler and needs nothing
else. The shared object is cached under ~/.cache/tpserve/native, named by a hash of the source, the
headers the sources share (tpserve/kernels/native/*.h), the flags and the compiler's version, and written
under a temporary name first, so two ranks starting together on one machine never load a
half-written file. Where no compiler works, `load` says why and the caller serves with its torch
kernel instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "native"
# -ffp-contract=off: a multiply and an add are never fused behind the code's back, so a vector lane
# and the scalar tail round alike (the code writes each fused multiply-add it wants as fmaf).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
COMPILE_TIMEOUT_S = 120


class NativeUnavailable(RuntimeError):
    """No C kernel here: no compiler, or it failed (the message says which)."""


def cache_dir() -> Path:
    return Path.home() / ".cache" / "tpserve" / "native"


@cache
def load(name: str) -> ctypes.CDLL:
    """The built kernel library `name` (tpserve/kernels/native/<name>.c), compiled here if not cached."""
    source = SOURCE_DIR / f"{name}.c"
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeUnavailable(f"{compiler} --version failed: {err}") from err
    # Every header beside the sources joins the hash: a source that includes one rebuilds when it
    # changes. -march=native: a build belongs to this CPU too (a cache shared with another machine
    # must not hand it instructions it lacks).
    headers = b"".join(path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join(FLAGS).encode() + version.encode() + _cpu().encode()
    ).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if not target.exists():
        _compile(compiler, source, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as err:
        raise NativeUnavailable(f"cannot load {target}: {err}") from err


def _cpu() -> str:
    """The CPU's model name and flags (what -march=native builds for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compile(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise NativeUnavailable(f"{compiler} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: a rank starting beside us loads a whole file or none
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeUnavailable(f"{compiler} could not build {source.name}: {err}") from err
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


KERNELS = (
    "attention",
    "rms_norm",
    "int8_rows",
    "fp16_linear",
    "q4_linear",
    "q4f_linear",
    "q5_linear",
    "q5f_linear",
    "q8_linear",
    "q6_linear",
    "shm_exchange",  # not a kernel: the shared-memory collectives' step (tpserve/kernels/shared_memory.py)
    "beat",  # not a kernel: the liveness link's beats (tpserve/ranks/beats.py)
)


def main() -> int:
    """`python -m tpserve.kernels.native`: build every kernel now; 1 with the reason if one fails."""
    try:
        for name in KERNELS:
            load(name)
    except NativeUnavailable as err:
        print(f"tpserve: C kernels unavailable: {err}")
        return 1
    print(f"tpserve: C kernels built in {cache_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
