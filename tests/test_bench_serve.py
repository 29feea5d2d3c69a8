"""`nanoinfer bench serve` end to end against a real nanoinfer server on loopback (a tiny
random model), run in-process through the CLI; and its pure parts (arrivals, SLOs, lengths)."""
from __future__ import annotations

import json
import math
import random

import pytest

from nanoinfer.bench import serve
from nanoinfer.cli import main
from nanoinfer.errors import NanoinferError

from server_utils import free_port, run_server

LATENCIES = ("ttft", "tpot", "itl", "e2el")
KEYS = {"bench", "url", "model", "config", "completed", "failed", "errors", "duration_s", "total_input_tokens",
        "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
        "request_goodput", "versions", "machine",
        *(f"{s}_{m}_ms" for m in LATENCIES for s in ("mean", "median", "p99"))}


@pytest.fixture(scope="module")
def url(make_hf_model):
    _, path = make_hf_model("llama")
    with run_server(["--model", str(path), "--log-level", "warning"]) as u:
        yield u


def bench(capsys, url: str, *extra: str, n: int = 6) -> tuple[int, dict, str]:
    """Run the bench in-process; (exit code, the last stdout line as JSON, all stdout)."""
    rc = main(["bench", "serve", "--url", url, "-n", str(n), "--input-len", "24", "--output-len", "8",
               "--ignore-eos", "--timeout", "50", *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out.strip().splitlines()[-1]), out


def check_ok(r: dict, n: int, ratio: float = 0.0) -> None:
    assert r.keys() >= KEYS
    assert (r["completed"], r["failed"], r["errors"]) == (n, 0, {})
    # ignore_eos: every reply is max_tokens long, 8 give or take the range ratio
    assert n * int(8 * (1 - ratio)) <= r["total_output_tokens"] <= n * int(8 * (1 + ratio))
    assert r["total_input_tokens"] > 0 and r["prompts_sized_by"] == "tokenize"
    for m in LATENCIES:
        mean, med, p99 = (r[f"{s}_{m}_ms"] for s in ("mean", "median", "p99"))
        assert mean > 0 and 0 < med <= p99, m
    assert r["median_ttft_ms"] <= r["median_e2el_ms"]
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert r["total_token_throughput"] > r["output_throughput"]


def test_rate_mode(capsys, url):
    rc, r, out = bench(capsys, url, "--request-rate", "20", "--seed", "3")
    assert rc == 0
    check_ok(r, 6)
    assert r["config"]["request_rate"] == 20 and r["config"]["concurrency"] is None
    assert r["url"] == url and r["endpoint_path"] == "/v1/completions" and r["model"]
    assert "request throughput (req/s)" in out and "TTFT" in out  # the readable table


def test_concurrency_mode(capsys, url):
    rc, r, _ = bench(capsys, url, "--concurrency", "2", "--range-ratio", "0.5")
    assert rc == 0
    check_ok(r, 6, ratio=0.5)
    assert r["max_in_flight"] == 2


def test_chat_endpoint(capsys, url, tmp_path):
    plot = tmp_path / "serve.png"
    rc, r, _ = bench(capsys, url + "/v1/", "--endpoint", "chat", "--concurrency", "3", "--plot", str(plot), n=4)
    assert rc == 0
    check_ok(r, 4)
    assert r["endpoint_path"] == "/v1/chat/completions" and r["url"] == url  # the /v1 suffix is dropped
    assert plot.stat().st_size > 0


def test_failures_are_counted_not_raised(capsys):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc, r, out = bench(capsys, dead, "--model", "x", n=5)
    assert rc == 1  # nothing completed: a script notices, but the report is there
    assert (r["completed"], r["failed"]) == (0, 5)
    assert r["errors"] == {"connect_error": 5}
    assert r["duration_s"] < 10 and r["mean_ttft_ms"] is None
    assert "connect_error" in out


def test_goodput(capsys, url):
    _, r, _ = bench(capsys, url, "--goodput", "ttft:0.001", n=4)
    assert r["completed"] == 4 and r["request_goodput"] == 0
    assert r["config"]["goodput_slos_ms"] == {"ttft": 0.001}
    _, r, _ = bench(capsys, url, "--goodput", "ttft:60000", "tpot:60000", "e2el:60000", n=4)
    assert r["completed"] == 4 and r["request_goodput"] == pytest.approx(r["request_throughput"])


# --- pure parts ------------------------------------------------------------------------------
def test_arrivals_are_poisson_and_seeded():
    assert serve.arrival_offsets(random.Random(0), 5, math.inf) == [0.0] * 5
    a = serve.arrival_offsets(random.Random(1), 4000, 10.0)
    assert a == serve.arrival_offsets(random.Random(1), 4000, 10.0)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate


def test_lengths_and_prompts():
    lens = serve.uniform_lens(random.Random(0), 500, 100, 0.5)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 50
    assert serve.uniform_lens(random.Random(0), 3, 7, 0.0) == [7, 7, 7]
    # a prompt's first words do not depend on its length; prompts differ from the start
    assert serve.prompt_words(0, 1, 40).startswith(serve.prompt_words(0, 1, 10))
    assert serve.prompt_words(0, 1, 10) != serve.prompt_words(0, 2, 10)


def test_goodput_slos_parse():
    assert serve.parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert serve.parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["e2el:-1"], ["tpot:inf"]):
        with pytest.raises(NanoinferError):
            serve.parse_goodput(bad)


def test_slo_check_and_tpot():
    r = serve.RequestResult(True, ttft=0.1, itl=[0.02] * 4, e2el=0.2, output_tokens=5)
    assert r.tpot == pytest.approx(0.025)
    assert serve.meets_slos(r, {"ttft": 100.0, "tpot": 25.0, "e2el": 200.0})
    assert not serve.meets_slos(r, {"tpot": 20.0})
    one = serve.RequestResult(True, ttft=0.1, e2el=0.1, output_tokens=1)
    assert one.tpot is None and serve.meets_slos(one, {"tpot": 0.0})  # no TPOT to miss


def test_bad_arguments_fail_cleanly(capsys):
    for extra in (["--concurrency", "0"], ["--request-rate", "0"], ["--range-ratio", "1"], ["--goodput", "foo:1"]):
        assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *extra]) == 1
        assert "error:" in capsys.readouterr().err


def test_timeouts_bound_the_run(capsys):
    """A server that accepts connections and never answers: requests time out one by one
    (--request-timeout), then the run stops at its --timeout with the rest counted."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)  # the kernel completes the handshakes; nobody ever reads
        t0 = time.monotonic()
        rc = main(["bench", "serve", "--url", f"http://127.0.0.1:{s.getsockname()[1]}", "--model", "x", "-n", "4",
                   "--concurrency", "1", "--request-timeout", "1", "--timeout", "4.5", "--warmup", "0"])
        elapsed = time.monotonic() - t0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and elapsed < 9
    assert (r["completed"], r["failed"]) == (0, 4) and r["run_timed_out"]
    assert "timeout" in r["errors"] and set(r["errors"]) <= {"timeout", "run_timeout", "not_sent"}
