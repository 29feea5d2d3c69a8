"""The tests' own builds of the kernels: one source of csrc/ (or the whole library) with flags
added to the build's (after $NANOINFER_CXXFLAGS), cached by cpu_kernels.build like the library:
the tests' way to run a form of a kernel this CPU's own build leaves out.

Some of them take a compiler minutes. Those start in the background as soon as the session
knows it will run the tests that load them: conftest.py, once -k and -m have deselected, asks
each test module with selected tests for its `background_builds(names)`. The suite's mostly
single-threaded tests leave a core for them; a test then waits for its build (built_with, wait)
and finds it in the kernel cache (keyed by flags and sources, not by who built it)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanoinfer.kernels import cpu_kernels

SIMDE_AVX512 = Path("/usr/include/simde/x86/avx512.h")
# The AVX-512 kernels built against SIMDe's portable intrinsics, and the AVX-VNNI ones with AVX2
# code for vpdpbusd: those paths on CPUs without them. At -O1: the emulated builds check the
# paths' integers and bits, not their speed. At the kernels' -O3, SIMDe's 512-bit operations
# inlined into every tile took quant_gemm.cpp over 13 minutes of one core on a Zen 3 (AVX2
# only), against 2 at -O1 and 4.4 at -O2.
EMULATED = "-DQG_EMULATE_AVX512 -O1"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Build:
    flags: str        # added to $NANOINFER_CXXFLAGS
    source: str = ""  # one file of csrc/, or "" for the whole library (cpu_kernels.SOURCES)
    csrc: Path = cpu_kernels.CSRC

    def sources(self) -> list[Path]:
        return [self.csrc / self.source] if self.source else [self.csrc / s.name for s in cpu_kernels.SOURCES]


EMULATED_LIBRARY = Build(EMULATED)


def env(flags: str) -> dict[str, str]:
    """The environment of a process that builds (or loads) with `flags` added."""
    return dict(os.environ, NANOINFER_CXXFLAGS=f"{os.environ.get('NANOINFER_CXXFLAGS', '')} {flags}")


# A build in its own process: cpu_kernels.build with the build's sources (errors show when a
# test loads it, which builds again and reports). At the lowest priority, it and its compilers:
# they take the core the tests leave idle rather than slowing the tests that run beside them.
_BUILD = ("import os, sys; from pathlib import Path; from nanoinfer.kernels import cpu_kernels as k; os.nice(19); "
          "k.build(k.find_compiler(), Path(sys.argv[1]), [Path(p) for p in sys.argv[3:]], sys.argv[2])")
_running: dict[Build, subprocess.Popen] = {}


def start(build: Build) -> None:
    if build not in _running and cpu_kernels.find_compiler() is not None:
        # a session of its own, so that stop() ends the compilers it starts with it
        _running[build] = subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(build.csrc), build.flags, *map(str, build.sources())], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait(build: Build) -> None:
    """The build finished, where it was started in the background (else its user builds it)."""
    if build in _running:
        _running[build].communicate(timeout=900)


def stop() -> None:
    """At the session's end: a build nobody waited for (the test failed first, or the run stopped) ends too."""
    for proc in _running.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the compilers too: killed alone, they ran on as orphans
            proc.wait()


def built_with(build: Build, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """The build's one source built (after its background build, if one was started), its entry
    points declared by `declare`."""
    wait(build)
    path, err = cpu_kernels.build(cpu_kernels.find_compiler(), build.csrc, build.sources(), build.flags)
    assert err is None, err
    lib = ctypes.CDLL(str(path))
    declare(lib)
    return lib
