"""One source of csrc/ built on its own with flags added to the build's (after
$NANOINFER_CXXFLAGS), cached by cpu_kernels.build like the library, loaded: the tests' way to run
a form of a kernel this CPU's own build leaves out."""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from nanoinfer.kernels import cpu_kernels


def built_with(flags: str, source: str, declare: Callable[[ctypes.CDLL], None],
               csrc: Path = cpu_kernels.CSRC) -> ctypes.CDLL:
    """csrc/`source` built with `flags`, its entry points declared by `declare`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NANOINFER_CXXFLAGS", f"{os.environ.get('NANOINFER_CXXFLAGS', '')} {flags}")
        path, err = cpu_kernels.build(cpu_kernels.find_compiler(), csrc, [csrc / source])
    assert err is None, err
    lib = ctypes.CDLL(str(path))
    declare(lib)
    return lib
