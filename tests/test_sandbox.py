"""The code sandbox: results, limits, and that nothing it starts outlives it or writes outside."""
from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanoinfer.tools import sandbox
from nanoinfer.tools.sandbox import ExecutionResult, execute_code

PRINT_CWD = "import os, sys\nprint(os.getcwd(), flush=True)\n"


def processes_in(directory: str) -> list[int]:
    """Live processes whose working directory is (or was, before deletion) `directory`."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/cwd").startswith(directory):
                found.append(int(pid))
        except OSError:  # gone meanwhile, or a zombie
            pass
    return found


def assert_nothing_left(result: ExecutionResult) -> None:
    cwd = result.stdout.splitlines()[0]
    assert cwd.startswith("/") and not os.path.exists(cwd)  # the temporary directory is gone
    deadline = time.monotonic() + 2  # SIGKILL'ed processes may take a moment to be torn down
    while processes_in(cwd) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_in(cwd) == []


def test_hello_world():
    r = execute_code("print('hello world')")
    assert r.success and r.stdout == "hello world\n" and r.error is None
    assert not r.timeout and not r.memory_exceeded
    assert set(r.to_dict()) >= {"success", "stdout", "stderr", "error", "timeout", "memory_exceeded"}


def test_exception_is_reported():
    r = execute_code("def f():\n    raise ValueError('bad input')\nf()")
    assert not r.success and "ValueError: bad input" in r.error and "Traceback" in r.stderr
    r = execute_code("1/0")
    assert not r.success and r.error.startswith("ZeroDivisionError")
    r = execute_code("def f(:")
    assert not r.success and r.error.startswith("SyntaxError")
    r = execute_code("import sys; print('out'); sys.exit(3)")
    assert not r.success and r.stdout == "out\n" and r.error == "exit code 3"


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    r = execute_code(PRINT_CWD + "while True:\n    pass", timeout=1)
    assert time.monotonic() - start < 3
    assert r.timeout and not r.success and r.error == "timeout"
    assert_nothing_left(r)


@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "l = []\nwhile True:\n    l.append('x' * 10**6)"])
def test_memory_bomb(code):
    start = time.monotonic()
    r = execute_code(code, timeout=10)
    assert time.monotonic() - start < 10
    assert r.memory_exceeded and not r.success and not r.timeout and "memory" in r.error


@pytest.mark.parametrize("bomb", [
    "while True:\n    os.fork()",
    "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()",
    "import subprocess\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])",
    "import subprocess\nsubprocess.run('sleep 60 &', shell=True)",
    "os.system('sleep 60 &')",
    "import pty\npty.spawn('sh')",
])
def test_fork_bombs_are_contained(bomb):
    start = time.monotonic()
    r = execute_code(PRINT_CWD + bomb, timeout=3)
    assert time.monotonic() - start < 6
    assert not r.success and "PermissionError" in r.error and "disabled in the sandbox" in r.error
    assert_nothing_left(r)


def test_background_child_escaping_the_group_is_gone():
    # Popen(start_new_session=True) is refused at the Python level ...
    r = execute_code("import subprocess\nsubprocess.Popen(['sleep', '60'], start_new_session=True)")
    assert not r.success and "disabled in the sandbox" in r.error
    # ... but that guard can be undone (ctypes); then the PID namespace is the wall.
    escape = PRINT_CWD + (
        "del sys.modules['ctypes'], sys.modules['_ctypes']\n"
        "import ctypes\n"
        "libc = ctypes.CDLL(None)\n"
        "for _ in range(3):\n"
        "    if libc.fork() == 0:\n"
        "        libc.setsid()  # leave the process group: killpg cannot reach it\n"
        "        import time; time.sleep(60)\n"
        "print('parent done')\n")
    r = execute_code(escape, timeout=5)
    if not r.pid_isolated:
        pytest.skip("no PID namespace here: a ctypes-escaped setsid child can outlive the sandbox")
    assert r.success and "parent done" in r.stdout
    assert_nothing_left(r)


def test_writes_outside_the_directory_are_refused():
    target = f"/tmp/nanoinfer-sandbox-test-{uuid.uuid4().hex}.txt"
    for attempt in [f"open({target!r}, 'w').write('x')", f"open({target!r}, 'a')", f"open({target!r}, 'x')",
                    f"import pathlib; pathlib.Path({target!r}).write_text('x')",
                    f"import pathlib; pathlib.Path({target!r}).touch()",
                    f"os.open({target!r}, os.O_WRONLY | os.O_CREAT)", "open('../escape.txt', 'w')",
                    f"os.mkdir({target!r})", f"import shutil; shutil.copy('/etc/passwd', {target!r})"]:
        r = execute_code("import os\n" + attempt)
        assert not r.success and "PermissionError" in r.error, attempt
        assert not os.path.exists(target), attempt
    r = execute_code("import os, pathlib\nopen('a.txt', 'w').write('inside')\nos.makedirs('d/e')\n"
                     "pathlib.Path('d/e/b.txt').write_text('ok')\nprint(open('a.txt').read(), open('d/e/b.txt').read())\n"
                     "print(len(open('/etc/passwd').read()) > 0)")  # reads stay allowed
    assert r.success and r.stdout == "inside ok\nTrue\n", r.stderr


def test_destructive_functions_are_disabled():
    for call in ["os.remove('x')", "os.unlink('x')", "os.rmdir('x')", "os.rename('a', 'b')", "os.chdir('/')",
                 "os.chmod('.', 0o777)", "os.kill(os.getpid(), 9)", "os.killpg(0, 9)", "os.putenv('A', 'B')",
                 "os.setsid()", "os.execv('/bin/sh', ['sh'])", "import shutil; shutil.rmtree('.')",
                 "import shutil; shutil.move('a', 'b')", "import posix; posix.unlink('x')", "help()"]:
        r = execute_code("import os\n" + call)
        assert not r.success and "disabled in the sandbox" in r.error, call


def test_limits_cannot_be_raised():
    r = execute_code("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))")
    assert not r.success and "ValueError" in r.error


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("NANOINFER_SANDBOX_SECRET", "hunter2")
    r = execute_code("import os\nprint(sorted(os.environ))")
    assert r.success and "NANOINFER_SANDBOX_SECRET" not in r.stdout and "'PATH'" in r.stdout
    assert "HOME" not in r.stdout


def test_network_is_blocked_where_supported():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
                "except OSError as e:\n    print('blocked', e)")
        r = execute_code(code)
    if not r.network_isolated:
        pytest.skip("no network namespace available here: the sandbox's network is NOT isolated")
    assert r.success and r.stdout.startswith("blocked"), r.stdout


def test_huge_output_is_truncated_fast():
    start = time.monotonic()
    r = execute_code("print('x' * 10**8)\nimport sys\nsys.stderr.write('e' * 10**7)", maximum_memory_bytes=1024**3)
    assert time.monotonic() - start < 10
    assert r.success, r.error
    cap = sandbox.OUTPUT_LIMIT_BYTES
    assert r.stdout.startswith("x" * cap) and "[truncated" in r.stdout and len(r.stdout) < cap + 100
    assert "[truncated" in r.stderr and len(r.stderr) < cap + 100


def test_stdin_is_closed():
    r = execute_code("input()")
    assert not r.success and r.error.startswith("EOFError")


def test_unprivileged_flag_matches_the_uid():
    r = execute_code("import os\nprint(os.getuid())")
    assert r.success
    if r.unprivileged:
        assert r.stdout.strip() != "0"
    elif os.geteuid() == 0:
        # root whose interpreter is not world-readable (e.g. under /root): no uid switch possible
        assert r.stdout.strip() == "0"


def test_concurrent_executions_from_threads():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: execute_code(f"print({i} * 2)"), range(8)))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(8)]
    assert all(r.success for r in results)


def test_uid_switch_makes_file_permissions_a_real_wall(monkeypatch):
    # The venv's interpreter may live under /root (not world-readable): then there is no uid switch.
    # A system interpreter usually is world-readable, so use it to exercise the switch.
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or system_python is None:
        pytest.skip("needs root and a system python3")
    monkeypatch.setattr(sandbox, "PYTHON", system_python)
    target = f"/etc/nanoinfer-sandbox-test-{uuid.uuid4().hex}"
    r = execute_code("import os, _io\nprint(os.getuid())\nopen('mine.txt', 'w').write('ok')\n"
                     f"_io.FileIO({target!r}, 'w')  # bypasses the Python-level guard")
    if not r.unprivileged:
        pytest.skip("the system python's files are not world-readable here: no uid switch")
    assert r.stdout == "65534\n"
    assert "PermissionError" in r.error and not os.path.exists(target)  # refused by the kernel
