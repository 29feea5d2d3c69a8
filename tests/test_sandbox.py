"""The code sandbox: results, limits, and that nothing it starts outlives it or writes outside."""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
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
    # refused by the Python-level guard, or first by the kernel (Landlock: no /dev/ptmx)
    refused_by_kernel = r.filesystem_isolated and "out of pty devices" in r.error
    assert not r.success and ("PermissionError" in r.error and "disabled in the sandbox" in r.error or refused_by_kernel)
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
                     "import json, decimal, sqlite3, hashlib\nprint(json.dumps([1]))")  # the standard library reads
    assert r.success and r.stdout == "inside ok\n[1]\n", r.stderr


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


# The program finds processes outside its PID namespace through /proc (its PPid: the relay; the
# relay's PPid: the caller) and tries to take them over through /proc/<pid>/mem. Harmless even if
# it works: it writes into the relay's code only the bytes that are already there, and never
# writes into the caller.
ATTACK_OUTSIDE = r'''
import _io, json, os
def status(pid):
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)
def parent(pid):
    try:
        return int(status(pid)["PPid"])
    except (OSError, KeyError, ValueError):
        return 0
depth = len(status("self")["NSpid"].split())
outside = []  # visible pids of a PID namespace above ours (fewer NSpid levels)
for name in os.listdir("/proc"):
    try:
        if name.isdigit() and len(status(name)["NSpid"].split()) < depth:
            outside.append(int(name))
    except (OSError, KeyError):
        pass
targets, pid = [], parent("self")  # 0 when /proc shows only our own namespace
while pid > 1 and len(targets) < 2:
    targets.append(pid)
    pid = parent(pid)
report = {"outside_visible": len(outside), "targets": targets, "got": {}}
def attempt(what, pid, action):
    try:
        report["got"][f"{what} {pid}"] = action()
    except OSError as e:
        report.setdefault("refused", {})[f"{what} {pid}"] = type(e).__name__
def code_start(pid):
    with open(f"/proc/{pid}/maps") as f:
        return next(int(line.split("-")[0], 16) for line in f if line.split()[1] == "r-xp")
def read_mem(pid):
    with _io.FileIO(f"/proc/{pid}/mem", "r") as mem:
        mem.seek(code_start(pid))
        return mem.read(16).hex()
def write_mem(pid):  # _io.FileIO: below the Python-level guard, as any determined program would go
    with _io.FileIO(f"/proc/{pid}/mem", "r+") as mem:
        if pid != targets[0]:
            return "opened for writing"
        mem.seek(start := code_start(pid))
        data = mem.read(16)
        mem.seek(start)
        return f"wrote {mem.write(data)} bytes into its code"
def read_environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().decode(errors="replace")
for pid in targets:
    attempt("environ", pid, lambda: read_environ(pid))
    attempt("read mem", pid, lambda: read_mem(pid))
    attempt("write mem", pid, lambda: write_mem(pid))
print(json.dumps(report))
'''


def run_attack() -> dict:
    r = execute_code(ATTACK_OUTSIDE, timeout=10)
    assert r.success, r.stderr  # the sandbox itself returns normally
    return json.loads(r.stdout)


def test_program_cannot_write_into_processes_outside_its_pid_namespace():
    report = run_attack()
    assert not [k for k in report["got"] if k.startswith("write mem")], report
    assert os.getpid() > 0 and execute_code("print('still here')").stdout == "still here\n"  # caller alive


def test_program_cannot_read_memory_or_environment_of_the_relay():
    report = run_attack()
    assert report["got"] == {}, report


# Run as the caller's uid without capabilities: what a sandboxed program that could see the relay
# (and the program's own process) through some /proc would be. Both must refuse it: non-dumpable.
PROBE_MEM = r'''
import ctypes, sys
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.capset(ctypes.byref(Header(0x20080522, 0)), (ctypes.c_uint32 * 6)()) == 0
for pid in sys.argv[1:]:
    try:
        open(f"/proc/{pid}/mem", "rb").close()
        print(pid, "opened")
    except OSError as e:
        print(pid, type(e).__name__)
'''


def sandbox_root(token: str) -> str | None:
    """The temporary directory of the running sandbox whose code contains `token`."""
    for program in glob.glob(os.path.join(tempfile.gettempdir(), "nanoinfer-sandbox-*", "program.py")):
        try:
            with open(program, errors="replace") as f:
                if token in f.read():
                    return os.path.dirname(program)
        except OSError:  # another sandbox, just removed
            pass
    return None


def sandbox_processes(root: str) -> list[int]:
    """Host pids of the relay and the program: the guard's config in their cmdline names `root`."""
    found = []
    for pid in os.listdir("/proc"):  # cmdline stays readable when the process is not dumpable; cwd not
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if root.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_relay_and_program_are_not_dumpable():
    token = uuid.uuid4().hex
    code = f"# {token}\nimport os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.02)\n"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(execute_code, code, 10)
        deadline, root, pids = time.monotonic() + 5, None, []
        while len(pids) < 2 and time.monotonic() < deadline and not future.done():
            time.sleep(0.05)
            root = root or sandbox_root(token)
            pids = sandbox_processes(root) if root else []
        try:
            probe = subprocess.run([sys.executable, "-c", PROBE_MEM, *map(str, pids)],
                                   capture_output=True, text=True, timeout=30)
        finally:
            if root:
                open(os.path.join(root, "work", "go"), "w").close()
        r = future.result()
    assert r.success, r.stderr
    if not r.pid_isolated:
        pytest.skip("no PID namespace here: there is no relay")
    assert len(pids) == 2 and probe.returncode == 0, (pids, probe.stderr)
    assert probe.stdout.split() == [w for pid in pids for w in (str(pid), "PermissionError")], probe.stdout


# --- the kernel's walls (issue 25) ------------------------------------------------------------------
# Before: the file guard was Python-level only (open.__wrapped__ and a re-imported posix wrote
# outside), and with the interpreter under /root the program ran as root and read /etc/shadow.

def _kernel_walls(r: ExecutionResult) -> None:
    if not r.filesystem_isolated:
        pytest.skip("no Landlock on this kernel: the sandbox's file system is NOT isolated by the kernel")


ESCAPES = {
    "open.__wrapped__": "import builtins\nbuiltins.open.__wrapped__({path!r}, 'w').write('x')",
    "re-imported posix": "import sys\ndel sys.modules['posix']\nimport posix\n"
                         "posix.close(posix.open({path!r}, posix.O_WRONLY | posix.O_CREAT, 0o644))",
    "os.open": "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
    "_io.FileIO": "import _io\n_io.FileIO({path!r}, 'w').write(b'x')",
    "ctypes open(2)": "import sys\nfor m in ('ctypes', '_ctypes'):\n    sys.modules.pop(m, None)\nimport ctypes\n"
                      "libc = ctypes.CDLL(None, use_errno=True)\nfd = libc.open({path!r}.encode(), 0o101, 0o644)\n"
                      "assert fd >= 0, ctypes.get_errno()",
}


@pytest.mark.parametrize("where", ["/tmp", "home", "cwd"])
@pytest.mark.parametrize("how", list(ESCAPES))
def test_writes_outside_are_refused_by_the_kernel(how, where):
    folder = {"/tmp": "/tmp", "home": os.path.expanduser("~"), "cwd": os.getcwd()}[where]
    path = os.path.join(folder, f"nanoinfer-sandbox-escape-{uuid.uuid4().hex}")
    try:
        r = execute_code(ESCAPES[how].format(path=path))
        _kernel_walls(r)
        assert not r.success, r.stdout
        assert not os.path.exists(path), (how, where)
    finally:
        if os.path.exists(path):
            os.remove(path)


def test_reads_are_confined_to_what_the_program_needs():
    secret = ("/etc/shadow" if os.path.exists("/etc/shadow") else "/etc/passwd")
    r = execute_code("import sys\nfor m in ('ctypes', '_ctypes'):\n    sys.modules.pop(m, None)\nimport ctypes\n"
                     f"libc = ctypes.CDLL(None)\nprint(libc.open({secret!r}.encode(), 0))\n"
                     f"print(open({secret!r}).read())")
    _kernel_walls(r)
    assert r.stdout.splitlines()[0] == "-1" and "PermissionError" in r.error


def test_root_callers_run_the_program_unprivileged_with_every_wall():
    """As CI runs (root, the interpreter under /root): the program still drops to nobody (the
    unreachable sys.path entries are bind-mounted where it can read them) inside Landlock."""
    r = execute_code("import os\nprint(os.getuid(), os.geteuid())")
    _kernel_walls(r)
    assert r.success, r.stderr
    if os.geteuid() == 0 and r.pid_isolated:
        assert r.unprivileged and r.stdout == f"{sandbox.UNPRIVILEGED_ID} {sandbox.UNPRIVILEGED_ID}\n"
