"""How a Python reward function is called: where it runs, for how long, and what a call that never returns
costs. One :class:`FunctionExecutor` per ``rewards.<name>`` function
(:class:`~rlhf_train.rewards.function_source.FunctionRewardSource` owns it and turns what comes back into scores).

* ``rewards.<name>.workers`` (default :data:`DEFAULT_WORKERS`): ``N >= 1`` worker processes of this
  function, each called with one contiguous slice of the batch's rows (``B // N`` or ``B // N + 1`` rows),
  the slices' results concatenated in order, so a function that scores each row on its own gives exactly
  what one call on the whole batch gives (a function that compares rows with each other needs
  ``workers: 1``); ``0``: in the trainer's process, in a thread (an ``async def`` function: on an event loop).
* ``rewards.<name>.timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`; ``null``: no limit): seconds from handing
  a batch over to having its result. A slice not back by then scores ``None`` for its rows (counted:
  ``faults/reward_timeouts``); its worker process is killed (SIGKILL) and replaced for the next batch. A
  worker that dies (a segfault, ``os._exit``, the OOM killer) is the same: ``None`` for its rows, counted,
  replaced. A thread cannot be killed: with ``workers: 0`` a timed-out call's thread is left running (a
  daemon thread, so it never holds up the exit) and the next batch gets a new one; an ``async def``
  function is cancelled.
* A Python exception raised by the function (``sys.exit`` included) is not a timeout: it comes back as
  :attr:`Slice.raised`, which the source turns into a ``RewardFunctionError`` (the batch is skipped, counted).
* ``async def`` functions in the trainer's process are awaited on one event loop in a daemon thread, shared
  by all of them, so several run concurrently (and beside the reward models and the reference pass); in a
  worker process, on that worker's own loop, kept across calls (clients bound to it stay usable).

Why the default is one worker process and a 60 s limit: a process is the only place a hung or crashing
verifier can be stopped without stopping the trainer, and the function runs in that process's main thread,
where signal-based timeouts (such as ``math-verify``'s) work; one worker keeps TRL's one call per batch.
60 s is far above what an answer check needs (``final_answer_match``: 6-21 ms per completion in
``benchmarks/reward_functions.py``, 0.4-1.3 s for 64 rows) and bounds what a hang costs to a minute per
batch; code-execution verifiers or big batches may need more (``rewards.<name>.timeout_s``).

Why a pool of its own rather than ``concurrent.futures.ProcessPoolExecutor`` or ``multiprocessing.Pool``:
neither can stop one task. A hung call holds its worker until the whole pool is shut down, a worker that
dies breaks a ``ProcessPoolExecutor`` for good (``BrokenProcessPool``) and leaves ``Pool.map`` waiting
forever. Here each worker has its own pipe, so a stuck or dead one is killed and replaced alone.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (its atexit hook is registered before ours, so ours runs first)
import pickle
import signal
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_WORKERS = 1       # rewards.<name>.workers when unset: one worker process (see the module docstring)
DEFAULT_TIMEOUT_S = 60.0  # rewards.<name>.timeout_s when unset
EXECUTION_KEYS = ("workers", "timeout_s")  # the keys of a rewards.<name> entry that are not the function's


def is_async(fn: Callable) -> bool:
    """An ``async def`` function, or a partial / instance of one (``async def __call__``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def describe(err: BaseException) -> str:
    """What the function raised, as the source's error line says it: ``ValueError: boom``."""
    if isinstance(err, Exception):
        return f"{type(err).__name__}: {err}"
    # sys.exit(), a KeyboardInterrupt raised by the function itself, ...: also a fault of the function
    return f"{type(err).__name__}{f'({err})' if str(err) else ''} (it must return, not exit)"


@dataclass
class Slice:
    """One call's outcome for rows ``lo:hi``: what it returned (``out``), or ``raised`` (the function's
    exception, :func:`describe`'d; ``error``: the exception itself when it ran in this process), or
    ``lost`` (why the rows have no result: a timeout, a dead worker), or ``unusable`` (a worker's result that
    does not pickle, described). ``seconds``: the call's own time."""

    lo: int
    hi: int
    out: Any = None
    raised: str | None = None
    error: BaseException | None = None
    lost: str | None = None
    unusable: str | None = None  # a result that could not come back from its worker: what it was
    seconds: float = 0.0


@dataclass
class _Call:
    """A batch handed over: its slices, each a Future (in this process) or with worker ``i`` (``errors``:
    slices that failed on the way to their worker)."""

    bounds: list[tuple[int, int]]
    started: float
    deadline: float | None
    futures: list[Future] | None = None
    errors: dict[int, Slice] | None = None


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(lo, hi)`` slices of ``range(n)``, sizes differing by at most one (one empty
    slice when ``n == 0``: the function is still called, as in one call)."""
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + size + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class FunctionExecutor:
    """Calls ``fn(prompts=..., completions=..., **columns)`` on a batch: :meth:`submit` hands it over and
    returns at once, :meth:`collect` waits (at most until the deadline) and returns one :class:`Slice` per
    call. Worker processes start on the first submit, from the calling thread (a worker asks to be killed
    when the thread that started it ends: start it from the loop's thread); :meth:`close` stops them."""

    def __init__(self, fn: Callable, name: str = "function", workers: int = 0, timeout_s: float | None = None):
        self.fn, self.name, self.workers, self.timeout_s = fn, name, int(workers), timeout_s
        self.is_async = is_async(fn)
        self._slots: list[list] = [[None, None] for _ in range(self.workers)]  # [process, connection] each
        self._pending: _Call | None = None
        self._finalizer = weakref.finalize(self, _stop_slots, self._slots)

    # ------------------------------------------------------------------ the trainer's side
    def submit(self, prompts: list[str], completions: list[str], columns: dict[str, Any]) -> _Call:
        if self._pending is not None:  # the last batch was never collected (its caller failed): settle it
            self.collect(self._pending)
        now = time.perf_counter()
        call = _Call(split(len(completions), self.workers or 1), now,
                     None if self.timeout_s is None else now + self.timeout_s)

        def rows(lo, hi):
            return {"prompts": prompts[lo:hi], "completions": completions[lo:hi],
                    **{k: v[lo:hi] if hasattr(v, "__getitem__") and not isinstance(v, (str, bytes)) else v
                       for k, v in columns.items()}}

        if self.workers == 0:
            too_slow = self._too_slow("it was cancelled") if self.timeout_s is not None else ""
            call.futures = [_in_process(self.fn, rows(lo, hi), self.is_async, self.timeout_s, too_slow)
                            for lo, hi in call.bounds]
        else:
            call.errors = {}
            for i, (lo, hi) in enumerate(call.bounds):
                for _attempt in (0, 1):  # a worker that died while idle: start another and send again
                    try:
                        self._slot(i)[1].send(rows(lo, hi))
                        break
                    except (BrokenPipeError, ConnectionError, EOFError):
                        self._kill(i)
                    except Exception as err:  # the rows do not pickle (a column of odd objects)
                        call.errors[i] = Slice(lo, hi, raised=f"{describe(err)} when its rows were sent to a worker "
                                                              f"process (set rewards.{self.name}.workers=0)")
                        break
                else:
                    call.errors[i] = Slice(lo, hi, lost="its worker process could not be started")
        self._pending = call
        return call

    def collect(self, call: _Call) -> list[Slice]:
        """One :class:`Slice` per slice of the batch, in row order; never waits past the deadline."""
        if self._pending is call:
            self._pending = None
        if call.futures is not None:
            return [self._wait_future(f, lo, hi, call) for f, (lo, hi) in zip(call.futures, call.bounds)]
        out: dict[int, Slice] = dict(call.errors or {})
        waiting = {i: b for i, b in enumerate(call.bounds) if i not in out}
        while waiting:
            remaining = None if call.deadline is None else max(0.0, call.deadline - time.perf_counter())
            handles = [h for i in waiting for h in (self._slots[i][1], self._slots[i][0].sentinel)]
            ready = multiprocessing.connection.wait(handles, timeout=remaining)
            for i, (lo, hi) in list(waiting.items()):
                process, conn = self._slots[i]
                if conn in ready or process.sentinel in ready:
                    out[i] = self._receive(i, lo, hi, call)
                    del waiting[i]
            if not ready:  # the deadline: the slices still out are lost; their workers are killed
                for i, (lo, hi) in waiting.items():
                    self._kill(i)
                    out[i] = Slice(lo, hi, lost=self._too_slow("its worker process was killed and is replaced"),
                                   seconds=self.timeout_s or 0.0)
                break
        return [out[i] for i in sorted(out)]

    def close(self) -> None:
        """Stop the worker processes (a later submit starts new ones)."""
        _stop_slots(self._slots)

    # ------------------------------------------------------------------ internals
    def _too_slow(self, then: str) -> str:
        return f"did not return within rewards.{self.name}.timeout_s={self.timeout_s:g} s ({then})"

    def _wait_future(self, future: Future, lo: int, hi: int, call: _Call) -> Slice:
        remaining = None if call.deadline is None else max(0.0, call.deadline - time.perf_counter())
        try:  # (an async call cancels itself at the limit: a little longer for that)
            result = future.result(timeout=remaining + 1.0 if self.is_async and remaining is not None else remaining)
        except FutureTimeout:
            if self.is_async:  # the loop itself is stuck (a blocking call inside an `async def`): a new one
                _LOOP.abandon()
                then = "the event loop was blocked: it is left running and a new one is used"
            else:
                then = "its thread is left running: a thread cannot be stopped; workers>=1 runs it in a process"
            result = Slice(lo, hi, lost=self._too_slow(then), seconds=self.timeout_s or 0.0)
        result.lo, result.hi = lo, hi
        return result

    def _receive(self, i: int, lo: int, hi: int, call: _Call) -> Slice:
        process, conn = self._slots[i]
        try:
            if conn.poll():
                kind, value, seconds = conn.recv()
                if kind == "ok":
                    return Slice(lo, hi, out=value, seconds=seconds)
                if kind == "raised":
                    return Slice(lo, hi, raised=value, seconds=seconds)
                return Slice(lo, hi, unusable=value, seconds=seconds)
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        process.join(timeout=1.0)
        code = process.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               and -code in signal.valid_signals() else f"exit code {code}")
        self._kill(i)
        return Slice(lo, hi, lost=f"crashed: its worker process died ({how}; a new one is started)",
                     seconds=time.perf_counter() - call.started)

    def _slot(self, i: int) -> list:
        slot = self._slots[i]
        if slot[0] is None or not slot[0].is_alive():
            if slot[0] is not None:
                self._kill(i)
            ctx = multiprocessing.get_context(start_method())
            ours, theirs = ctx.Pipe(duplex=True)
            _PARENT_ENDS.add(ours)  # (before the fork: the child closes its copy)
            process = ctx.Process(target=_worker, args=(theirs, self.fn), name=f"reward-{self.name}-{i}", daemon=False)
            process.start()
            theirs.close()
            slot[0], slot[1] = process, ours
        return slot

    def _kill(self, i: int) -> None:
        _stop_slot(self._slots[i])


def start_method() -> str:
    """``fork`` on Linux while this process has not initialised CUDA (a worker starts in milliseconds and
    shares the trainer's memory copy-on-write, as a DataLoader worker does); else ``spawn``: a forked child
    of a process that initialised CUDA inherits its driver state and cannot use CUDA, and on macOS fork is
    unsafe with the system frameworks (Python's own default there is spawn)."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return "spawn" if cuda is not None and cuda.is_initialized() else "fork"


# ---------------------------------------------------------------------- in the trainer's process
class _EventLoop:
    """One event loop in a daemon thread for every in-process ``async def`` reward function; one that is
    blocked (a coroutine called a blocking function) is abandoned and later calls get a new one."""

    def __init__(self):
        self.loop, self.lock = None, threading.Lock()

    def get(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="reward-async", daemon=True).start()
            return self.loop

    def abandon(self) -> None:
        with self.lock:
            self.loop = None


_LOOP = _EventLoop()


def _in_process(fn: Callable, kwargs: dict, async_fn: bool, timeout_s: float | None, too_slow: str) -> Future:
    """The call in this process, a Future of its :class:`Slice`: a coroutine on the shared loop (cancelled at
    ``timeout_s``: a Slice with ``lost = too_slow``), or a daemon thread (a new one per call: a thread left
    running by a timeout never delays the next batch)."""
    if async_fn:
        async def timed():
            t0 = time.perf_counter()
            task = asyncio.ensure_future(fn(**kwargs))
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:  # the limit (the function's own TimeoutError, if it raises one, is a raise)
                task.cancel()
                return Slice(0, 0, lost=too_slow, seconds=time.perf_counter() - t0)
            try:
                return Slice(0, 0, out=task.result(), seconds=time.perf_counter() - t0)
            except BaseException as err:  # noqa: BLE001  (the function's own raise, whatever it is)
                return Slice(0, 0, raised=describe(err), error=err, seconds=time.perf_counter() - t0)

        return asyncio.run_coroutine_threadsafe(timed(), _LOOP.get())
    future: Future = Future()

    def target():
        t0 = time.perf_counter()
        try:
            out = fn(**kwargs)
            if inspect.isawaitable(out):  # a plain function that returned a coroutine
                out = asyncio.run_coroutine_threadsafe(_awaited(out), _LOOP.get()).result()
            result = Slice(0, 0, out=out)
        except BaseException as err:  # noqa: BLE001
            result = Slice(0, 0, raised=describe(err), error=err)
        result.seconds = time.perf_counter() - t0
        future.set_result(result)

    threading.Thread(target=target, name="reward-fn", daemon=True).start()
    return future


def in_thread(fn: Callable[[], Any]) -> Future:
    """``fn()`` in a daemon thread, no limit: a Future of its :class:`Slice` (a source that overlaps the
    others but is not a reward function)."""
    return _in_process(fn, {}, False, None, "")


async def _awaited(awaitable):
    return await awaitable


# ---------------------------------------------------------------------- in a worker process
_PARENT_ENDS: "weakref.WeakSet" = weakref.WeakSet()  # this process's ends of every worker's pipe


def _worker(conn, fn: Callable) -> None:
    """A worker process: read rows, call ``fn``, send ``(kind, value, seconds)`` back, until the pipe closes."""
    from rlhf_train.infra.preemption import die_with_parent

    die_with_parent()  # never outlive the trainer (even one that exited with os._exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's preemption handler, inherited by fork
    for other in list(_PARENT_ENDS):  # forked: the trainer's ends of other workers' pipes (keeps EOF working)
        other.close()
    torch = sys.modules.get("torch")
    if torch is not None:  # forked from a trainer whose OpenMP pool ran: a parallel region here would hang
        torch.set_num_threads(1)  # (as torch's DataLoader workers do); one thread per worker in any case
    loop = None
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        try:
            out = fn(**kwargs)
            if inspect.isawaitable(out):
                loop = loop or asyncio.new_event_loop()
                out = loop.run_until_complete(out)
            message = ("ok", out)
        except BaseException as err:  # noqa: BLE001  (sys.exit() too: the function's fault, reported)
            message = ("raised", describe(err))
        seconds = time.perf_counter() - t0
        try:
            conn.send((*message, seconds))
        except Exception:  # the result does not pickle: say what it was instead
            conn.send(("unsendable", f"{type(message[1]).__name__}: {str(message[1])[:80]}", seconds))


def _stop_slot(slot: list) -> None:
    process, conn = slot
    slot[0] = slot[1] = None
    if conn is not None:
        conn.close()
    if process is not None:
        process.kill()  # idle or stuck alike: it holds no state worth a graceful stop
        process.join(timeout=1.0)


def _stop_slots(slots: list) -> None:
    for slot in slots:
        _stop_slot(slot)


@atexit.register
def _stop_all() -> None:
    """At exit (before multiprocessing's own hook, which would wait for them): every live executor's workers."""
    for process in multiprocessing.active_children():
        if process.name.startswith("reward-"):
            process.kill()
            process.join(timeout=1.0)
