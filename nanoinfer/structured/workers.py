"""Where a grammar engine's work runs, so that no constraint can stall or crash the engine.

- Compiles run one thread each, with a COMPILE_STACK_BYTES stack (the compiler recurses; the
  limits in limits.py keep it far inside that), at most `slots` at once. The caller waits at
  most the compile's time limit, and the first mask's CPU budget (read from the compile
  thread's own CPU clock while it runs): a compile past either is answered then and finishes
  unobserved at the lowest priority (native code cannot be interrupted); at most `max_runaway`
  such, after which compiles are refused as busy until they end.
- Each step's masks run on a few worker threads while the engine thread waits, at most the
  step's budget. llguidance releases the GIL while it computes, so masks of several rows run
  side by side and the engine thread's wait is a real wait. A mask still running at the
  deadline is abandoned with its thread (a fresh thread takes its place) and its row fails;
  the other rows go on with this step's masks.

Both kinds of thread run at a lower CPU priority (nice): on a machine whose cores all run the
model's threads, a compile or an abandoned mask would otherwise take cores from them, and the
model's threads meet at barriers, so one descheduled thread stalls them all (measured: a 0.4 s
gap in a running stream while three 0.2 s compiles ran on two cores). The engine thread waits
while a step's masks run, so those get the cores they need; an abandoned mask drops to nice 19.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from ..errors import ConstraintError
from .limits import COMPILE_STACK_BYTES

T = TypeVar("T")
COMPILE_NICE, MASK_NICE = 5, 0  # a compile yields to the model; a step's masks run while the engine waits for them
ABANDONED_NICE = 19  # ~1/70: a mask given up on still finishes (and frees its thread), in what the model leaves
_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


def _nice(native_id: int | None, value: int) -> None:
    try:  # on Linux a thread is a task: this sets that thread's own nice value (raising it needs no privilege)
        os.setpriority(os.PRIO_PROCESS, native_id or 0, value)
    except (AttributeError, OSError, TypeError):
        pass


def _start(target: Callable[[], None], name: str, nice: int, stack_bytes: int = 0) -> threading.Thread:
    def run() -> None:
        _nice(threading.get_native_id(), nice)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _stack_lock:
        old = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(old)
    return thread


class CompileRunner:
    """Compiles, each on a thread of its own: at most `slots` running, at most `max_runaway` given
    up on and still running (they release their slot when given up; past that, compiles are
    refused as busy until some finish)."""

    POLL = 0.01  # seconds between looks at a compile's clocks

    def __init__(self, slots: int = 2, max_runaway: int = 8):
        self._slots = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()
        self.max_runaway = max_runaway
        self.runaway = 0

    def run(self, compile: Callable[[], T], check: Callable[[T], None], seconds: float, check_cpu_seconds: float,
            param: str | None) -> T:
        """compile() then check(result) on a big-stack thread. ConstraintError once the whole
        takes more than `seconds` of wall clock (waiting for a slot included), or check() more
        than `check_cpu_seconds` of that thread's CPU time: the caller is answered then, not
        when the native code returns."""
        deadline = time.monotonic() + seconds
        with self._lock:
            busy = self.runaway >= self.max_runaway
        if busy or not self._slots.acquire(timeout=seconds):
            raise ConstraintError("the constraint compiler is busy (compiles past their limits are still running); "
                                  "try again later", param, code="constraint_timeout")
        future: Future = Future()
        state = {"phase": "compile", "cpu0": 0.0, "clock": None, "given_up": False, "released": False}

        def release() -> None:  # under self._lock
            if not state["released"]:
                state["released"] = True
                self._slots.release()

        def work() -> None:
            state["clock"] = _own_cpu_clock()
            try:
                result = compile()
                state["cpu0"], state["phase"] = time.thread_time(), "check"
                check(result)
                future.set_result(result)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)
            finally:
                with self._lock:
                    release()
                    if state["given_up"]:
                        self.runaway -= 1

        try:
            thread = _start(work, "nanoinfer-compile", COMPILE_NICE, COMPILE_STACK_BYTES)
        except BaseException:
            with self._lock:
                release()
            raise
        while True:
            try:
                return future.result(timeout=self.POLL)
            except TimeoutError:
                pass
            if time.monotonic() > deadline:
                error = ConstraintError(f"compiling the constraint took more than {seconds:g} s", param,
                                        code="constraint_timeout")
            elif state["phase"] == "check" and _cpu_seconds(state["clock"]) - state["cpu0"] > check_cpu_seconds:
                error = ConstraintError(f"the constraint's first mask took more than {check_cpu_seconds * 1000:.0f} ms "
                                        f"of CPU time (the budget)", param, code="constraint_too_slow")
            else:
                continue
            with self._lock:
                if not future.done():  # give it up: it finishes unobserved, at the lowest priority
                    state["given_up"] = True
                    self.runaway += 1
                    release()
                    _nice(thread.native_id, ABANDONED_NICE)
            if future.done():
                return future.result()
            raise error


def _own_cpu_clock() -> int | None:
    """The calling thread's CPU clock. Taken by the thread itself: asked for from another thread
    (pthread_getcpuclockid on its ident), a thread that has already ended is a freed pthread
    handle, and glibc reads it (a fast compile's thread can end before its caller asks: the
    server died of SIGSEGV under 21 concurrent schema requests)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError, TypeError):
        return None


def _cpu_seconds(clock: int | None) -> float:
    """A thread's CPU time by its clock; 0 where there is none or its thread has ended (the
    kernel then refuses the clock: the caller's next look finds the result)."""
    if clock is None:
        return 0.0
    try:
        return time.clock_gettime(clock)
    except OSError:
        return 0.0


class _Job:
    __slots__ = ("fn", "state", "error", "thread")

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.state, self.error = fn, "queued", None  # queued -> running -> done | abandoned
        self.thread: int | None = None  # the native id of the thread running it


class MaskWorkers:
    """Run a step's mask jobs side by side; each job is done, or abandoned at the deadline."""

    def __init__(self, threads: int = 4):
        self.threads = threads
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._alive = 0
        self.abandoned = 0  # jobs given up on so far (each took a thread with it)

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
                job.state, job.thread = "running", threading.get_native_id()
            try:
                job.fn()
            except BaseException as e:  # noqa: BLE001 - reported through the job
                job.error = e
            with self._cv:
                if job.state == "abandoned":  # a fresh thread has taken this one's place
                    return
                job.state = "done"
                self._cv.notify_all()

    def _fill(self) -> None:
        while self._alive < self.threads:
            _start(self._worker, "nanoinfer-masks", MASK_NICE)
            self._alive += 1

    def run(self, fns: list[Callable[[], None]], budget: float) -> list[_Job]:
        """Run every fn; return when all are done or abandoned. A job still running when
        `budget` seconds have passed is abandoned; jobs that had not started then get a fresh
        budget (they waited only because every thread was held by an abandoned one)."""
        jobs = [_Job(fn) for fn in fns]
        with self._cv:
            self._fill()
            self._queue.extend(jobs)
            self._cv.notify_all()
            deadline = time.monotonic() + budget
            while True:
                open_jobs = [j for j in jobs if j.state in ("queued", "running")]
                if not open_jobs:
                    return jobs
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                for j in open_jobs:
                    if j.state == "running":
                        j.state = "abandoned"
                        _nice(j.thread, ABANDONED_NICE)
                        self._alive -= 1
                        self.abandoned += 1
                self._fill()
                self._cv.notify_all()
                deadline = time.monotonic() + budget
