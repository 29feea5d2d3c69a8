"""Run a nanoinfer server in a real subprocess for tests, and a scripted-model server.

    with run_server(["--model", str(path)]) as url:      # python -m nanoinfer.server ...
        ...

The server is stopped with SIGINT (uvicorn's graceful shutdown), then killed if it hangs.
Its output goes to a log file, shown when it fails to start.

`python tests/server_utils.py scripted --tokenizer DIR --scripts JSON --port N` serves a model
that writes fixed text (chosen by a keyword in the prompt), for tool-call tests: a random
tiny model never writes a tool call.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Graceful stop; returns the exit code (killed if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(args: list[str], *, command: list[str] | None = None, startup_timeout: float = 120.0,
                 attempts: int = 3) -> ServerProcess:
    """Start `python -m nanoinfer.server ARGS --host 127.0.0.1 --port P` and wait for /health."""
    command = command or [sys.executable, "-m", "nanoinfer.server"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    for attempt in range(attempts):
        port = free_port()
        log = Path(tempfile.mkstemp(prefix="nanoinfer-server-", suffix=".log")[1])
        with open(log, "wb") as out:
            proc = subprocess.Popen([*command, *args, "--host", "127.0.0.1", "--port", str(port)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        server = ServerProcess(f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        server.stop(signal.SIGKILL)
        # Another process may have taken the port between free_port() and the bind: try again.
        if "address already in use" not in server.output().lower() or attempt == attempts - 1:
            raise RuntimeError(f"server did not start (exit {proc.returncode}):\n{server.output()[-4000:]}")
    raise AssertionError("unreachable")


@contextlib.contextmanager
def run_server(args: list[str], **kwargs) -> Iterator[str]:
    """Yield the base URL of a running server; stop it gracefully afterwards. A server that
    exited on its own meanwhile is an error that shows its log (a test's own failure, a
    disconnected request, says nothing of why)."""
    server = start_server(args, **kwargs)
    try:
        yield server.url
    finally:
        exited = server.proc.poll()
        server.stop()
        if exited is not None:
            raise RuntimeError(f"the server exited on its own (code {exited}); its log {server.log}:\n"
                               f"{server.output()[-4000:]}")


@contextlib.contextmanager
def serve_in_thread(app, startup_timeout: float = 60.0) -> Iterator[str]:
    """Serve an ASGI app built in this process (so a test can reach into it) on a thread; yield its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def scripted_server_command(tokenizer_dir: Path, scripts: dict[str, str]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "scripted", "--tokenizer", str(tokenizer_dir),
            "--scripts", json.dumps(scripts)]


# --- a server whose model writes what the test says -----------------------------------------

def _scripted_main(argv: list[str]) -> int:
    import argparse

    import torch
    from torch import nn

    from nanoinfer.config import ModelConfig
    from nanoinfer.engine import EngineConfig, LLMEngine
    from nanoinfer.models.builder import LoadedModel
    from nanoinfer.server import ServerConfig, serve
    from nanoinfer.tokenizer import Tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["scripted"])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--scripts", required=True, help='JSON {"keyword": "text to write", ...}')
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    tok = Tokenizer.from_hf_folder(a.tokenizer)
    scripts = {k: tok.encode(v, add_special_tokens=False) + [tok.eos_token_id]
               for k, v in json.loads(a.scripts).items()}
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    anchor = newline[0]

    class ScriptedModel(nn.Module):
        """Writes a script, one token per position after the prompt. The prompt ends with the
        generation prompt's newline; the script is the one whose keyword comes last in the
        prompt (so a later turn can pick another). Scripts must not contain a newline."""

        def __init__(self, config: ModelConfig):
            super().__init__()
            self.config = config
            self.anchor = nn.Parameter(torch.zeros(1))
            self.base, self.script = 0, [tok.eos_token_id]  # one request at a time

        def forward(self, batch):  # a ForwardBatch
            input_ids, positions, logits_indices = batch.input_ids, batch.positions, batch.logits_indices
            rows = [] if logits_indices is None else logits_indices.tolist()
            logits = torch.full((len(rows), self.config.vocab_size), -10.0)
            for r, at in enumerate(rows):
                pos = int(positions[at])
                if int(input_ids[at]) == anchor:  # the end of a prompt: choose the script
                    text = tok.decode(input_ids.tolist(), skip_special_tokens=False)
                    self.base, self.script = pos, scripts[max(scripts, key=lambda k: text.rfind(k))]
                k = pos - self.base
                logits[r, self.script[k] if 0 <= k < len(self.script) else tok.eos_token_id] = 10.0
            return logits

    config = ModelConfig("scripted", tok.vocab_size, 8, 16, 1, 1, 1, 8, max_position_embeddings=4096)
    loaded = LoadedModel(ScriptedModel(config), tok, config, Path(a.tokenizer), "scripted", 0.0)
    # The whole prompt in one forward (no prefix cache, no chunks): the model reads its keyword.
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=1 << 22, enable_prefix_caching=False,
                                            max_num_batched_tokens=4096))
    serve(engine, ServerConfig(model_name="scripted", shutdown_timeout=2.0), host=a.host, port=a.port,
          log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(_scripted_main(sys.argv[1:]))
