"""The AVX-512 kernels built against SIMDe's portable intrinsics, and the AVX-VNNI ones with AVX2
code for vpdpbusd (test_quant_kernels.py's test_simd_paths_through_emulation), started in the
background as soon as the session knows it will run that test: the build is two minutes of one
compiler process, which the suite's mostly single-threaded tests leave a core for. The test
waits for it, then finds it in the kernel cache (keyed by the flags)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

SIMDE_AVX512 = Path("/usr/include/simde/x86/avx512.h")
# -O1: the emulated builds check the paths' integers and bits, not their speed. At the kernels' -O3,
# SIMDe's 512-bit operations inlined into every tile took quant_gemm.cpp over 13 minutes of one
# core on a Zen 3 (AVX2 only), against 2 at -O1 and 4.4 at -O2.
FLAGS = "-DQG_EMULATE_AVX512 -O1"
ROOT = Path(__file__).resolve().parent.parent
_build: subprocess.Popen | None = None


def env() -> dict[str, str]:
    return dict(os.environ, NANOINFER_CXXFLAGS=FLAGS)


def native() -> bool:
    """The CPU runs the AVX-512 (F, BW, VL, VNNI) and AVX-VNNI paths itself: nothing to emulate."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"} <= flags


def start() -> None:
    global _build
    if _build is None and SIMDE_AVX512.exists() and not native():
        # a session of its own, so that stop() ends the compilers it starts with it
        _build = subprocess.Popen([sys.executable, "-c", "from nanoinfer.kernels import cpu_kernels; cpu_kernels.library()"],
                                  cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)


def wait() -> None:
    """The build finished (started here if it was not); its errors, if any, show when the tests load it."""
    start()
    if _build is not None:
        _build.communicate(timeout=900)


def stop() -> None:
    """At the session's end: a build nobody waited for (the test deselected or the run stopped) ends too."""
    if _build is not None and _build.poll() is None:
        os.killpg(_build.pid, signal.SIGKILL)  # the compilers too: killed alone, they ran on as orphans
        _build.wait()
