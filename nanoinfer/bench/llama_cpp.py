"""The llama.cpp reference of `bench latency --compare llama.cpp`.

llama.cpp is never a dependency of nanoinfer and is never imported here: it runs in a
subprocess, `PYTHON -c SCRIPT`, with an interpreter that has llama-cpp-python installed
(`--llama-cpp-python PYTHON`, else $NANOINFER_LLAMA_CPP_PYTHON). SCRIPT uses only llama_cpp
and the standard library. It reads one JSON object on stdin (the GGUF file, our prompt's
token ids, the decode length, the threads), loads `Llama(...)`, warms up, times the prefill
(`eval(ids)` and the first greedy `sample`) and each decode step (`eval([tok])` and a greedy
`sample`, top_k=1), and prints one JSON line: prefill_tok_s, decode_tok_s (1 / median step,
as our TPOT), decode_tok_s_mean, ttft_s, tpot_s, load_s, version.
"""
from __future__ import annotations

import json
import os
import subprocess

from ..errors import NanoinferError

ENGINE = "llama.cpp"
ENV_VAR = "NANOINFER_LLAMA_CPP_PYTHON"

SCRIPT = r'''
import json, sys, time
import llama_cpp

cfg = json.loads(sys.stdin.read())
ids, decode_len = cfg["prompt"], cfg["decode_len"]
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                      n_threads_batch=cfg["threads"], n_batch=cfg["n_batch"], verbose=False)
load_s = time.perf_counter() - t0


def greedy():
    return llm.sample(top_k=1, temp=0.0)


# warm-up, as ours: a short prompt and a few steps, then start again from position 0
llm.reset()
llm.eval(ids[:min(len(ids), 32)])
for _ in range(3):
    llm.eval([greedy()])

llm.reset()
t0 = time.perf_counter()
llm.eval(ids)
tok = greedy()
ttft = time.perf_counter() - t0
steps = []
for _ in range(decode_len - 1):  # the first token came from the prefill, as ours
    t0 = time.perf_counter()
    llm.eval([tok])
    tok = greedy()
    steps.append(time.perf_counter() - t0)
s = sorted(steps)
n = len(s)
tpot = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
print(json.dumps({"prefill_tok_s": len(ids) / ttft, "decode_tok_s": 1.0 / tpot,
                  "decode_tok_s_mean": n / sum(steps), "ttft_s": ttft, "tpot_s": tpot,
                  "decode_steps": n, "load_s": load_s,
                  "version": getattr(llama_cpp, "__version__", "unknown")}))
'''


def resolve_python(flag: str | None) -> str:
    """The interpreter to run llama.cpp with: the flag, else the environment variable."""
    python = flag or os.environ.get(ENV_VAR)
    if not python:
        raise NanoinferError(f"--compare llama.cpp needs a Python with llama-cpp-python installed: "
                             f"give --llama-cpp-python PYTHON or set {ENV_VAR}")
    return python


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "no output"


def check_python(python: str, timeout: float = 120.0) -> str:
    """llama_cpp's version under `python`, or a one-line error saying what is wrong."""
    try:
        proc = subprocess.run([python, "-c", "import llama_cpp; print(getattr(llama_cpp, '__version__', 'unknown'))"],
                              capture_output=True, text=True, timeout=timeout)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        raise NanoinferError(f"--llama-cpp-python {python!r}: cannot run it ({e.strerror or e})") from None
    except OSError as e:
        raise NanoinferError(f"--llama-cpp-python {python!r}: cannot run it ({e})") from None
    except subprocess.TimeoutExpired:
        raise NanoinferError(f"--llama-cpp-python {python!r}: `import llama_cpp` took over {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise NanoinferError(f"--llama-cpp-python {python!r}: llama_cpp is not importable there "
                             f"({_last_line(proc.stderr)}); pip install llama-cpp-python in that environment")
    return _last_line(proc.stdout)


def run_llama_cpp(python: str, model: str, prompt: list[int], decode_len: int, threads: int,
                  n_batch: int = 512, timeout: float = 600.0) -> dict:
    """One batch-1 measurement by llama.cpp in a subprocess; the figures of its JSON line."""
    cfg = {"model": model, "prompt": prompt, "decode_len": decode_len, "threads": threads,
           "n_ctx": len(prompt) + decode_len + 16, "n_batch": n_batch}
    try:
        proc = subprocess.run([python, "-c", SCRIPT], input=json.dumps(cfg), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NanoinferError(f"llama.cpp did not finish within {timeout:.0f} s") from None
    except OSError as e:
        raise NanoinferError(f"--llama-cpp-python {python!r}: cannot run it ({e})") from None
    if proc.returncode != 0:
        raise NanoinferError(f"llama.cpp failed (exit {proc.returncode}): {_last_line(proc.stderr)}")
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    raise NanoinferError(f"llama.cpp printed no JSON line: {_last_line(proc.stdout + proc.stderr)}")
