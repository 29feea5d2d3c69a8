"""Run untrusted Python (HumanEval-style completions) in a fresh, limited interpreter.

What `execute_code` does, in order:

* Parent side: writes the program to a fresh temporary directory and starts
  `python -I -B -X utf8 -c <guard>` with cwd a `work/` folder inside it, the environment cut to
  `PATH`, stdin on /dev/null (so `input()` raises EOFError), in a new session and process group.
  stdout and stderr are read by one select loop (no deadlock whatever the child writes) and
  kept up to 1 MiB each; the rest is counted and dropped with a "[truncated ...]" marker.
* Child side, before the program runs (the guard):
  1. Namespaces, where the kernel allows them: a new network namespace (no interfaces, not even
     loopback up: every connection fails) and a new PID namespace (the program is its pid 1; when
     it exits, the kernel kills everything it started, even processes that left the process
     group). Tried as `unshare(NET|PID)`, then `unshare(NET)`, then inside a new user namespace.
     With a PID namespace the guard forks: it stays outside as the relay (waits, passes the exit
     status on, drops its capabilities) and the child runs steps 2-6 and the program. Both are
     made non-dumpable (PR_SET_DUMPABLE 0) before the fork, so /proc/<pid>/mem, environ, maps
     and ptrace need CAP_SYS_PTRACE, which nothing in the sandbox has: else the program, same
     uid as the relay, could write code into it and act in the host PID namespace (kill the
     caller). The child then enters a private mount namespace with a fresh /proc of its PID
     namespace (mount propagation off): no outside process is even visible.
  2. When the caller is root, it hands `work/` to uid/gid 65534 (nobody) and switches to it: then
     file permissions and RLIMIT_NPROC apply for real. The interpreter must still import its
     modules as nobody: a sys.path entry nobody cannot reach (a Python under /root, mode 700, as
     on the machines CI runs on) is first bind-mounted read-only onto a folder of the sandbox's
     in its private mount namespace, and sys.path (and the imported packages' __path__) point
     there. Without a mount namespace such a program keeps the caller's uid.
  3. Resource limits, soft = hard so the program cannot raise them: RLIMIT_AS and RLIMIT_DATA
     (`maximum_memory_bytes`), RLIMIT_STACK 8 MiB, RLIMIT_CPU ceil(timeout)+1 s, RLIMIT_FSIZE
     10 MiB, RLIMIT_NOFILE 256, RLIMIT_CORE 0, RLIMIT_NPROC (the uid's current tasks + 32; the
     kernel never enforces it for root).
  4. All capabilities dropped (capset) and PR_SET_NO_NEW_PRIVS set, so root-in-the-sandbox cannot
     raise its limits, re-enter the host network namespace, mount, or regain privileges by exec.
  5. Landlock (Linux >= 5.13, no privileges needed), enforced by the kernel whatever the program
     calls (ctypes, a re-imported posix, os.open, _io): it may read, write, create and remove
     only inside `work/`, read (and map) only its sys.path, the system library folders, its own
     program file, /dev/null, /dev/urandom, /dev/zero, the time-zone files and, with a private
     /proc, /proc; nothing else of the file system, /etc/shadow and the caller's files included.
     From Landlock ABI 4 TCP bind/connect are refused too, and from ABI 6 signals and abstract
     Unix sockets beyond the sandbox.
  6. Python-level guards: process creation, signalling, exec, deletion/renaming, chdir/chmod/
     chown, setuid/setsid, putenv and friends raise PermissionError (in `os` and `posix`), as do
     shutil.rmtree/move/chown, subprocess.*, _posixsubprocess.fork_exec and help(); `open`,
     `io.open`, `os.open` and `os.mkdir` refuse write/append/create outside the working directory
     (reads stay allowed); `import ctypes` fails. exit()/quit() stay: they only end the program.
* When the program exits, or at the timeout, its whole process group gets SIGKILL (before the
  leader is reaped, so the group id cannot have been reused). Without a PID namespace, processes
  whose working directory is still inside `work/` are killed too (they left the group). Then the
  temporary directory is removed.
* The result: `success` (exit code 0, no timeout), captured `stdout`/`stderr`, `error` (the last
  stderr line, e.g. "ZeroDivisionError: division by zero", or "timeout", "memory exceeded (...)",
  "exit code N", "killed by SIGSEGV"), `timeout` (wall clock or CPU limit), `memory_exceeded`
  (MemoryError, or an unexplained SIGKILL), and which walls were up: `network_isolated`,
  `pid_isolated`, `proc_isolated` (private /proc), `unprivileged` (non-root uid and no
  capabilities), `filesystem_isolated` (Landlock). `isolation()` reports them for this machine
  and `isolation_warning()` says which are missing; `eval humaneval` prints both.

What it does NOT protect against:

* The Python-level guards (step 6) are a speed bump, not a wall: code can re-import `posix` or
  `ctypes`, or reach the originals (`open.__wrapped__`). Steps 1-5 are what holds.
* Without Landlock (`filesystem_isolated=False`: Linux < 5.13, or Landlock off), the file system
  is guarded only by the uid: a program running as nobody can read whatever is world-readable
  and write to world-writable places such as /tmp; one that kept the caller's uid (no mount
  namespace for the uid switch) can read what the caller can, and through ctypes write it too.
  For root RLIMIT_NPROC is not enforced, so a ctypes fork bomb is bounded only by the timeout.
  There is no seccomp filter and no cgroup.
* If the kernel refuses namespaces, the network is open (`network_isolated=False`; with Landlock
  ABI >= 4 TCP is still refused), and a process that leaves both the process group and the
  working directory (via ctypes) can outlive the call. Without a PID namespace the program (via
  ctypes) can also signal every process of its uid (Landlock ABI >= 6 stops that), the caller
  included, and read and write the memory (/proc/<pid>/mem) of those that are dumpable and hold
  no capabilities: a non-root caller is one.
* Without a private /proc (`proc_isolated=False`: the mount was refused) the program sees every
  host process's pid, command line and status unless Landlock hides /proc (it does: /proc is
  readable only when private). The relay and the program themselves are non-dumpable.
* Filesystem Unix sockets (e.g. a Docker socket) are reachable even in a new network namespace
  unless Landlock is on (they are files outside the allowed folders).
* Disk use: RLIMIT_FSIZE bounds each file, not the number of files.
* Output still in the program's own stdout buffer is lost when it is killed at the timeout.
"""
from __future__ import annotations

import json
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

OUTPUT_LIMIT_BYTES = 1024 * 1024  # per stream
UNPRIVILEGED_ID = 65534  # nobody / nogroup
DRAIN_GRACE_S = 2.0  # after the group is killed: how long to wait for the pipes to close
_TAIL_BYTES = 4096  # last bytes of stderr kept for the error line, even when the head is full
PYTHON = sys.executable  # the interpreter the sandbox runs; a test may point it elsewhere


@dataclass
class ExecutionResult:
    """How a program ended (nanochat's fields first), and which isolation walls were up."""
    success: bool
    stdout: str
    stderr: str
    error: str | None = None
    timeout: bool = False
    memory_exceeded: bool = False
    network_isolated: bool = False  # the program ran in its own network namespace
    pid_isolated: bool = False  # ... and its own PID namespace (all its processes die with it)
    proc_isolated: bool = False  # ... whose /proc shows no process outside that namespace
    unprivileged: bool = False  # ... as a non-root uid without capabilities
    filesystem_isolated: bool = False  # ... confined by the kernel (Landlock) to its folder and what Python reads

    def to_dict(self) -> dict:
        return asdict(self)


# The guard runs in the child as `python -c _GUARD CONFIG_JSON`, before the program.
_GUARD = r'''
import ctypes, json, os, resource, signal, stat, sys

cfg = json.loads(sys.argv[1])
with open(cfg["program"], "rb") as f:
    source = f.read()
libc = ctypes.CDLL(None, use_errno=True)
status = {"network": False, "pid": False, "proc": False, "unprivileged": False, "filesystem": False}

# 1. namespaces
NEWNS, NEWUSER, NEWPID, NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
uid, gid = os.getuid(), os.getgid()
if libc.unshare(NEWNET | NEWPID) == 0:
    status.update(network=True, pid=True)
elif libc.unshare(NEWNET) == 0:
    status["network"] = True
elif libc.unshare(NEWUSER | NEWNET | NEWPID) == 0:
    # map our own ids so files we create keep their owner
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            pass
    status.update(network=True, pid=True)

# RLIMIT_NPROC (step 3) counts the uid's tasks host-wide: count them while /proc still shows them all
def tasks_by_uid():
    counts = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            owner = int(fields["Uid"].split()[0])
            counts[owner] = counts.get(owner, 0) + int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return counts

class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
def drop_capabilities():
    ok = libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), (CapData * 2)()) == 0
    libc.prctl(38, *map(ctypes.c_ulong, (1, 0, 0, 0)))  # PR_SET_NO_NEW_PRIVS
    return ok

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
def mount(source, target, fstype, flags):
    return libc.mount(source, target, fstype, ctypes.c_ulong(flags), None) == 0

tasks = tasks_by_uid()
if status["pid"]:
    # The relay (this process, outside the new PID namespace, same uid as the program) must be out
    # of the program's reach: /proc/<relay>/mem would let it run code in the host namespace and kill
    # anything of that uid, the caller included. Non-dumpable, /proc/<pid>/mem, environ, maps... and
    # ptrace need CAP_SYS_PTRACE, which no process in the sandbox has. Set before the fork, so the
    # program never runs next to a dumpable relay; it inherits the flag (other sandboxes' programs
    # cannot reach it either).
    libc.prctl(4, *map(ctypes.c_ulong, (0, 0, 0, 0)))  # PR_SET_DUMPABLE 0
    # The first child is pid 1 of the new namespace; this process stays outside and relays its end.
    child = os.fork()
    if child:
        os.close(cfg["status_fd"])
        drop_capabilities()  # it only waits; if it were ever reached, it could do no more than the program
        _, wstatus, usage = os.wait4(child, 0)
        if os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
            # pid 1 ignores SIGXCPU, so the CPU limit shows as the hard limit's SIGKILL: say which
            if sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cfg["cpu_seconds"]:
                sig = signal.SIGXCPU
            if sig != signal.SIGKILL:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        os._exit(os.waitstatus_to_exitcode(wstatus))
    # A /proc of our own namespace (in a private mount namespace) hides every outside process:
    # no pid, cmdline or status of the relay, the caller or anything else on the host.
    status["proc"] = (libc.unshare(NEWNS) == 0 and mount(None, b"/", None, MS_REC | MS_PRIVATE)  # no propagation out
                      and mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC))

# 2. leave root. The interpreter must still import its modules afterwards: a sys.path entry the
# new user cannot reach (under /root, mode 700) is bind-mounted, read-only, onto a folder of ours
# that it can reach, in our private mount namespace, and sys.path points there instead.
def world_readable(path):
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
    return True

MS_RDONLY, MS_REMOUNT, MS_BIND = 0x1, 0x20, 0x1000
drop = cfg["drop_to"]
if os.geteuid() == 0 and drop and status["proc"]:  # root, in a mount namespace of its own
    moved = {}
    for i, entry in enumerate(list(sys.path)):
        if os.path.isdir(entry) and not world_readable(entry):
            target = os.path.join(cfg["lib_root"], str(i))
            os.mkdir(target, 0o755)
            if mount(os.fsencode(os.path.realpath(entry)), os.fsencode(target), None, MS_BIND | MS_REC):
                mount(None, os.fsencode(target), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_REC)
                moved[entry] = sys.path[i] = target
    def moved_path(p):
        for old, new in moved.items():
            if p == old or p.startswith(old + os.sep):
                return new + p[len(old):]
        return p
    for module in list(sys.modules.values()):  # packages imported already find their submodules there too
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [moved_path(p) for p in search]
    sys.path_importer_cache.clear()
reachable = [p for p in sys.path if os.path.exists(p)]
if os.geteuid() == 0 and drop and all(world_readable(p) for p in reachable):
    try:
        os.chown(os.getcwd(), drop, drop)  # the working directory becomes the new user's
        os.setgroups([])
        os.setgid(drop)
        os.setuid(drop)
    except OSError:  # still root: give the directory back, or capless root could not write there
        try:
            os.chown(os.getcwd(), 0, 0)
        except OSError:
            pass

# 3. resource limits, hard ones too: without capabilities (step 4) nobody can raise them again
def limit(res, soft, hard=None):
    hard = soft if hard is None else hard
    cur = resource.getrlimit(res)[1]
    if cur != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur), min(hard, cur)
    try:
        resource.setrlimit(res, (soft, hard))
    except (ValueError, OSError):
        pass

if cfg["memory"]:
    limit(resource.RLIMIT_AS, cfg["memory"])
    limit(resource.RLIMIT_DATA, cfg["memory"])
limit(resource.RLIMIT_STACK, 8 * 1024 * 1024)
limit(resource.RLIMIT_CPU, cfg["cpu_seconds"], cfg["cpu_seconds"] + 1)
limit(resource.RLIMIT_FSIZE, 10 * 1024 * 1024)
limit(resource.RLIMIT_NOFILE, 256)
limit(resource.RLIMIT_CORE, 0)
if os.getuid() != 0:  # the kernel ignores RLIMIT_NPROC for root; for others it counts all their tasks
    limit(resource.RLIMIT_NPROC, tasks.get(os.getuid(), 0) + 32)

# 4. no capabilities, and no way to gain any through exec
no_caps = drop_capabilities()
status["unprivileged"] = no_caps and os.geteuid() != 0

# 5. Landlock (Linux >= 5.13, no privileges needed): the kernel confines the file system to the
# working directory (read and write) and what the interpreter reads (its sys.path, system
# libraries, a few device and time-zone files), whatever the program does: ctypes, a re-imported
# posix, os.open. From ABI 4 also TCP, from ABI 6 signals and abstract sockets, beyond ourselves.
SYS_CREATE, SYS_ADD, SYS_RESTRICT = 444, 445, 446  # x86_64 and arm64 share these numbers
class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
def landlock():
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net = 0b11 if abi >= 4 else 0  # bind and connect TCP: none allowed
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets and signals: only within the sandbox
    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    size = 8 * (3 if abi >= 6 else 2 if abi >= 4 else 1)
    ruleset = libc.syscall(SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    EXECUTE, READ_FILE, READ_DIR = 1, 1 << 2, 1 << 3
    file_rights = EXECUTE | 1 << 1 | READ_FILE | (1 << 14) | (1 << 15)  # what applies to a file, not a folder
    read = EXECUTE | READ_FILE | READ_DIR
    def allow(path, rights):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                rights &= file_rights
            rule = PathBeneath(rights & fs, fd)
            libc.syscall(SYS_ADD, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0))  # LANDLOCK_RULE_PATH_BENEATH
        finally:
            os.close(fd)
    allow(os.getcwd(), fs)  # the working directory: everything
    allow(cfg["program"], READ_FILE)  # tracebacks quote its lines
    for p in reachable:
        allow(p, read)
    for p in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache",
              "/etc/localtime", "/usr/share/zoneinfo", "/dev/urandom", "/dev/zero"):
        allow(p, read)
    allow("/dev/null", READ_FILE | 1 << 1)  # WRITE_FILE
    if status["proc"]:  # our own namespace's /proc
        allow("/proc", read)
    done = libc.syscall(SYS_RESTRICT, ruleset, ctypes.c_uint32(0)) == 0
    os.close(ruleset)
    return abi if done else 0
status["landlock_abi"] = landlock()
status["filesystem"] = status["landlock_abi"] > 0
if status["pid"]:  # after the uid switch, which clears it: die with the relay even outside its group
    libc.prctl(1, *map(ctypes.c_ulong, (signal.SIGKILL, 0, 0, 0)))  # PR_SET_PDEATHSIG
os.write(cfg["status_fd"], json.dumps(status).encode())
os.close(cfg["status_fd"])

# 6. second line of defence: Python-level guards
import builtins, errno, functools, io, _io, posix, shutil, subprocess, types
try:
    import _posixsubprocess
except ImportError:
    _posixsubprocess = None

def disabled(name):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EPERM, f"{name} is disabled in the sandbox")
    return refuse

for name in ("system", "popen", "kill", "killpg", "fork", "forkpty", "execl", "execle", "execlp", "execlpe",
             "execv", "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
             "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir",
             "removedirs", "rename", "renames", "replace", "truncate", "link", "symlink", "mknod", "mkfifo",
             "chdir", "fchdir", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot",
             "putenv", "unsetenv", "setuid", "seteuid", "setreuid", "setresuid", "setgid", "setegid",
             "setregid", "setresgid", "setgroups", "setsid", "setpgid", "setpgrp", "plock"):
    for module in (os, posix):
        if hasattr(module, name):
            setattr(module, name, disabled(f"os.{name}"))
for module, names in ((shutil, ("rmtree", "move", "chown")),
                      (subprocess, ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                                    "getstatusoutput")),
                      (_posixsubprocess, ("fork_exec",)), (signal, ("pidfd_send_signal",)),
                      (builtins, ("help",))):
    for name in names:
        if module is not None and hasattr(module, name):
            setattr(module, name, disabled(f"{module.__name__}.{name}"))

work = os.path.realpath(os.getcwd())
def inside(path):
    real = os.path.realpath(os.fsdecode(path))
    return real == work or real.startswith(work + os.sep)

def refuse_outside(path):
    raise PermissionError(errno.EACCES, "the sandbox only writes inside its working directory", str(path))

real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

@functools.wraps(real_open)
def guarded_open(file, mode="r", *args, **kwargs):
    if not isinstance(file, int) and set(mode) & set("wax+") and not inside(file):
        refuse_outside(file)
    return real_open(file, mode, *args, **kwargs)

@functools.wraps(real_os_open)
def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
    if flags & WRITE_FLAGS and (dir_fd is not None or not inside(path)):
        refuse_outside(path)
    return real_os_open(path, flags, mode, dir_fd=dir_fd)

@functools.wraps(real_mkdir)
def guarded_mkdir(path, mode=0o777, *, dir_fd=None):
    if dir_fd is not None or not inside(path):
        refuse_outside(path)
    return real_mkdir(path, mode, dir_fd=dir_fd)

builtins.open = io.open = _io.open = guarded_open
os.open = posix.open = guarded_os_open
os.mkdir = posix.mkdir = guarded_mkdir  # os.makedirs looks mkdir up in os at call time
sys.modules["ctypes"] = sys.modules["_ctypes"] = None  # import fails (a speed bump only)

# run the program as __main__, with a clean namespace
sys.argv = [cfg["program"]]
main = types.ModuleType("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
code = compile(source, cfg["program"], "exec")
del source, cfg, libc, status
exec(code, main.__dict__)
'''


@dataclass
class _Capture:
    """Keeps the first `limit` bytes of a stream, counts the rest, and remembers its last bytes."""
    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytes = b""
    dropped: int = 0

    def add(self, chunk: bytes) -> None:
        room = max(0, self.limit - len(self.head))
        self.head += chunk[:room]
        self.dropped += len(chunk) - min(room, len(chunk))
        self.tail = (self.tail + chunk)[-_TAIL_BYTES:]

    def text(self) -> str:
        text = self.head.decode("utf-8", "replace")
        return text + f"\n[truncated: {self.dropped} more bytes]" if self.dropped else text


WALLS = ("network_isolated", "pid_isolated", "proc_isolated", "unprivileged", "filesystem_isolated")


def isolation() -> dict[str, bool]:
    """The walls a program gets here (each execute_code reports its own; they do not change
    between calls): one trivial program's report."""
    r = execute_code("pass", timeout=10)
    return {w: getattr(r, w) for w in WALLS}


def isolation_warning(walls: dict[str, bool]) -> str | None:
    """One line naming the walls that are missing, or None."""
    missing = [w for w in WALLS if not walls.get(w)]
    if not missing:
        return None
    return ("WARNING: the sandbox runs model-written code WITHOUT " + ", ".join(missing) +
            " on this machine (see nanoinfer/tools/sandbox.py for what each wall stops)")


def execute_code(code: str, timeout: float = 5.0,
                 maximum_memory_bytes: int | None = 256 * 1024**2) -> ExecutionResult:
    """Run `code` in a sandboxed interpreter (see the module docstring) and report how it went."""
    root = tempfile.mkdtemp(prefix="nanoinfer-sandbox-")
    try:
        return _run(code, timeout, maximum_memory_bytes, root)
    except OSError as e:  # could not even start (no fds left, no disk, ...)
        return ExecutionResult(False, "", "", error=f"sandbox failed to start: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(code: str, timeout: float, maximum_memory_bytes: int | None, root: str) -> ExecutionResult:
    program, work, lib_root = os.path.join(root, "program.py"), os.path.join(root, "work"), os.path.join(root, "lib")
    with open(program, "wb") as f:
        f.write(code.encode("utf-8", "surrogatepass"))  # bad text then fails as a SyntaxError
    os.mkdir(work)
    os.mkdir(lib_root)
    os.chmod(lib_root, 0o755)
    if os.geteuid() == 0:  # the guard may switch to nobody: let it reach work/ (and show source lines)
        os.chmod(root, 0o711)
        os.chmod(program, 0o644)
    status_r, status_w = os.pipe()
    config = {"program": program, "memory": maximum_memory_bytes, "cpu_seconds": max(1, math.ceil(timeout) + 1),
              "drop_to": UNPRIVILEGED_ID, "status_fd": status_w, "lib_root": lib_root}
    try:
        proc = subprocess.Popen(
            [PYTHON, "-I", "-B", "-X", "utf8", "-c", _GUARD, json.dumps(config)],
            cwd=work, env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status_w,))
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        out, err, status, timed_out = _supervise(proc, timeout, status_r, work)
    finally:
        _kill_group(proc.pid)
        proc.kill()  # no-op unless something above failed before the group was killed
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
    return _result(proc.returncode, out, err, status, timed_out)


def _supervise(proc: subprocess.Popen, timeout: float, status_fd: int,
               work: str) -> tuple[_Capture, _Capture, _Capture, bool]:
    """Collect output until the program ends or the timeout; then kill its group and drain the pipes."""
    out, err, status = _Capture(OUTPUT_LIMIT_BYTES), _Capture(OUTPUT_LIMIT_BYTES), _Capture(4096)
    sel = selectors.DefaultSelector()
    streams = 3
    for fd, capture in ((proc.stdout.fileno(), out), (proc.stderr.fileno(), err), (status_fd, status)):
        sel.register(fd, selectors.EVENT_READ, capture)
    pidfd = _pidfd_open(proc.pid)
    if pidfd is not None:  # readable once the process exits; without it, poll waitid below
        sel.register(pidfd, selectors.EVENT_READ, None)
    deadline = time.monotonic() + timeout
    timed_out = exited = False
    try:
        while True:
            now = time.monotonic()
            if not exited:  # exited: the leader ended, or was killed at the timeout
                exited = _has_exited(proc.pid, pidfd)
                if not exited and now >= deadline:
                    timed_out = exited = True
                if exited:
                    # Kill the whole group at once, orphans included. The leader is not reaped yet,
                    # so its group id cannot have been reused by an unrelated process.
                    _kill_group(proc.pid)
                    if not _walls(status).get("pid"):  # no namespace to take escapees down with it
                        _kill_strays(work)
                    deadline = now + DRAIN_GRACE_S  # from now on: how long to wait for the pipes
                    if pidfd is not None:
                        sel.unregister(pidfd)
            elif now >= deadline:
                break  # something outside the group still holds the pipes; stop reading
            if exited and not streams:
                break
            poll_s = deadline - now if pidfd is not None or exited else min(deadline - now, 0.02)
            for key, _ in sel.select(timeout=max(0.0, poll_s)):
                if key.data is None:
                    continue  # the pidfd: handled at the top of the loop
                chunk = os.read(key.fd, 65536)
                if chunk:
                    key.data.add(chunk)
                else:
                    sel.unregister(key.fd)
                    streams -= 1
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return out, err, status, timed_out


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Python < 3.9, Linux < 5.3, or not Linux
        return None


def _has_exited(pid: int, pidfd: int | None) -> bool:
    """Whether the process has exited, without reaping it (the zombie keeps its pid and group id taken)."""
    if pidfd is not None:
        poller = select.poll()  # not select.select: fds above 1024 are fine
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_strays(directory: str) -> None:
    """SIGKILL processes still working in `directory`: ones that left the process group (setsid)."""
    for name in os.listdir("/proc"):
        try:
            if not name.isdigit() or not _cwd_in(f"/proc/{name}", directory):
                continue
            pidfd = os.pidfd_open(int(name))
            try:  # checked again through the pidfd's process, so a reused pid is never hit
                if _cwd_in(f"/proc/{name}", directory):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
        except (OSError, AttributeError):  # gone, a zombie, not ours to kill, or no pidfds here
            pass


def _cwd_in(proc_dir: str, directory: str) -> bool:
    cwd = os.readlink(f"{proc_dir}/cwd")
    return cwd == directory or cwd.startswith(directory + os.sep) or cwd == f"{directory} (deleted)"


def _walls(status: _Capture) -> dict:
    """What the guard reported: {"network", "pid", "proc", "unprivileged", "filesystem": bool,
    "landlock_abi": int}, or {}."""
    try:
        return json.loads(status.head.decode())
    except ValueError:  # the guard died before reporting (or has not reported yet)
        return {}


def _result(returncode: int, out: _Capture, err: _Capture, status: _Capture, timed_out: bool) -> ExecutionResult:
    walls = _walls(status)
    lines = [line.strip() for line in err.tail.decode("utf-8", "replace").splitlines() if line.strip()]
    last = lines[-1][:300] if lines else ""
    memory = last.startswith("MemoryError") or "Cannot allocate memory" in last
    cpu = returncode == -signal.SIGXCPU
    if timed_out:
        error = "timeout"
    elif cpu:
        error = "cpu time limit exceeded"
    elif memory:
        error = f"memory exceeded ({last})"
    elif returncode == -signal.SIGKILL:
        memory, error = True, "killed by SIGKILL (most likely out of memory)"
    elif returncode < 0:
        error = f"killed by {signal.Signals(-returncode).name}" if -returncode in signal.valid_signals() \
            else f"killed by signal {-returncode}"
    elif returncode != 0:
        error = last or f"exit code {returncode}"
    else:
        error = None
    return ExecutionResult(
        success=returncode == 0 and not timed_out, stdout=out.text(), stderr=err.text(), error=error,
        timeout=timed_out or cpu, memory_exceeded=memory,
        network_isolated=bool(walls.get("network")), pid_isolated=bool(walls.get("pid")),
        proc_isolated=bool(walls.get("proc")), unprivileged=bool(walls.get("unprivileged")),
        filesystem_isolated=bool(walls.get("filesystem")))
