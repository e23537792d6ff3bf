"""Grading in worker processes, each call under a hard wall-clock limit: the Grader runs cwgrpo.py's
math-verify reward here, and evaluate.py's grading.

math-verify's own timeout uses SIGALRM, which works only on a main thread and cannot interrupt
every hang (sympy evaluating 9^9^9^9), while killing a process always works. A call that overruns
has its worker killed and replaced, and its result is `on_timeout`. Workers ignore Ctrl-C and
SIGTERM (the parent decides what to do) and exit within a second of their parent's death, however
it dies.
"""

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple


def _serve(fn: Callable, conn, parent_pid: int) -> None:
    """A worker's loop: call fn on what arrives, send back the result, until the parent is gone."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # sent to the whole group: the parent decides
        signal.signal(stop, signal.SIG_IGN)
    if sys.platform == "linux":  # the kernel kills us when the parent dies, even mid-computation
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    while True:
        if os.getppid() != parent_pid:  # the parent died before prctl took effect, or not Linux
            return
        if not conn.poll(1.0):
            continue
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(fn(*args))


class _Worker:
    """One child process, started on first use and replaced after a call overruns."""

    def __init__(self, fn: Callable, timeout_s: float):
        self.fn, self.timeout_s, self.process = fn, timeout_s, None
        methods = multiprocessing.get_all_start_methods()
        self.context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")

    def call(self, args: tuple, on_timeout: Any) -> Any:
        if self.process is None:
            self.conn, child_conn = self.context.Pipe()
            self.process = self.context.Process(
                target=_serve, daemon=True, args=(self.fn, child_conn, os.getpid())
            )
            self.process.start()
            child_conn.close()
        self.conn.send(args)
        try:
            finished = self.conn.poll(self.timeout_s)
            result = self.conn.recv() if finished else on_timeout
        except (EOFError, OSError):  # the worker crashed (inside sympy, say): treat as a cutoff
            finished, result = False, on_timeout
        if not finished or not self.process.is_alive():
            self.close()
        return result

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.conn.close()
            self.process = None


class TimeoutPool:
    """fn(*args) for many args on `workers` processes, each call cut off after timeout_s seconds."""

    def __init__(self, fn: Callable, workers: int, timeout_s: float, on_timeout: Any = None):
        self.on_timeout = on_timeout
        self.workers = [_Worker(fn, timeout_s) for _ in range(max(1, workers))]
        self.threads = ThreadPoolExecutor(len(self.workers))  # each thread drives one worker

    def submit(self, calls: list[tuple]) -> Future:
        """A future of [fn(*args) for args in calls], in order, the calls shared among workers."""
        shares = [calls[i :: len(self.workers)] for i in range(len(self.workers))]
        parts = [
            self.threads.submit(lambda w=w, s=s: [w.call(a, self.on_timeout) for a in s])
            for w, s in zip(self.workers, shares)
        ]
        done, lock = Future(), threading.Lock()

        def gather(_):
            with lock:
                if done.done() or not all(p.done() for p in parts):
                    return
                try:
                    results = [p.result() for p in parts]
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    done.set_exception(error)
                    return
                ordered = [None] * len(calls)
                for i, share in enumerate(results):
                    ordered[i :: len(self.workers)] = share
                done.set_result(ordered)

        for part in parts:
            part.add_done_callback(gather)
        return done

    def map(self, calls: list[tuple]) -> list:
        return self.submit(calls).result()

    @property
    def size(self) -> int:
        return len(self.workers)

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)
        for worker in self.workers:
            worker.close()


class CachedTimeoutPool(TimeoutPool):
    """A TimeoutPool that remembers results, for pure functions: a cache hit is not recomputed."""

    def __init__(
        self,
        fn: Callable,
        workers: int,
        timeout_s: float,
        on_timeout: Any = None,
        max_cache: int = 200_000,
    ):
        super().__init__(fn, workers, timeout_s, on_timeout)
        self.max_cache, self.cache, self.lock = max_cache, {}, threading.Lock()

    def submit(self, calls: list[tuple]) -> Future:
        """A future of [fn(*args) for args in calls], in order; only the uncached calls run."""
        with self.lock:
            todo = list(dict.fromkeys(call for call in calls if call not in self.cache))
            if len(self.cache) + len(todo) > self.max_cache:
                self.cache.clear()
                todo = list(dict.fromkeys(calls))
        running, done = super().submit(todo), Future()

        def answer(finished: Future) -> None:
            try:
                with self.lock:
                    self.cache.update(zip(todo, finished.result()))
                    done.set_result([self.cache[call] for call in calls])
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                done.set_exception(error)

        running.add_done_callback(answer)
        return done


class Grade(NamedTuple):
    """A completion's grading: what grade functions return, and the pool on a timeout."""

    accuracy: float
    gold_parsed: bool  # False: the gold could not be parsed, so the accuracy is 0 by rule
    timed_out: bool  # grading was cut off (ours or math-verify's own limit), so the accuracy is 0


TIMED_OUT = Grade(0.0, gold_parsed=True, timed_out=True)  # a grading the pool's time limit cut off


class Grader(CachedTimeoutPool):
    """A grade function (cwgrpo.py's grade_accuracy, or evaluate.py's paper grading) in worker
    processes under a hard time limit, cached since grading is pure: a completion the limit cuts
    off gets `on_timeout`. workers 0: one per core, at most 8."""

    def __init__(self, grade: Callable, on_timeout, timeout_s: float = 10.0, workers: int = 1):
        workers = workers or min(8, os.cpu_count() or 1)
        super().__init__(grade, workers, timeout_s, on_timeout=on_timeout)

    def grade(self, completion: str, gold: str, gold_format: str = "default"):
        return self.map([(completion, gold, gold_format)])[0]


class LogCounter(logging.Handler):
    """Counts a logger's records that start with a prefix (a library's "Timeout during ..."
    warnings, say), and keeps that logger quiet."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.count = prefix, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith(self.prefix)

    @classmethod
    def installed(cls, logger_name: str, prefix: str) -> "LogCounter":
        logger = logging.getLogger(logger_name)
        found = [h for h in logger.handlers if isinstance(h, cls) and h.prefix == prefix]
        if not found:
            found = [cls(prefix)]
            logger.addHandler(found[0])
            logger.setLevel(logging.WARNING)
            logger.propagate = False
        return found[0]
