"""``python -m rlhf_train ARGS`` for the tests, forked from a server that has already imported the libraries.

Why: the suite runs the command line ~50 times, and each fresh interpreter spent ~7 s of CPU importing torch,
transformers (which imports torch._dynamo), tensordict and peft before doing anything (measured with a
per-process CPU log over the whole suite: 47 runs, 372 s of CPU of the suite's ~1,500). Here a server process
imports them once (:func:`serve`), then forks one child per run.

What a child shares with ``python -m rlhf_train``: it is a new process (its own pid, signals, exit status,
session when asked), ``rlhf_train/__main__.py`` runs as ``__main__`` through :mod:`runpy` as ``-m`` runs it
(so its CPU defaults, Hydra's set-up and its atexit handlers run as usual), with the given argv, cwd, env,
stdin/stdout/stderr and ``sys.path[0]`` (the cwd). What differs: the libraries were imported before the
run's environment was applied (the server has the test process's environment), so a run whose import-time
variables (:data:`IMPORT_TIME_PREFIXES`, ``PYTHONPATH`` aside: it only sets ``sys.path``) differ from the test
process's (a test's own ``HF_HOME``, say) starts ``sys.executable`` instead, as do the tests of the
interpreter's start itself (the CPU defaults' effect on a fresh process).

:func:`popen` and :func:`run` take the arguments of :class:`subprocess.Popen` / :func:`subprocess.run` that
the tests use (``cwd``, ``env``, ``stdout``, ``stderr``, ``capture_output``, ``text``, ``timeout``,
``start_new_session``, ``check``).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# variables read when torch, its OpenMP / malloc runtimes, transformers or huggingface_hub are loaded
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "GOMP_", "KMP_", "MALLOC_", "THP_", "LD_", "PYTHON", "TORCH", "PYTORCH_",
                        "CUDA", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "XDG_", "HOME")
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.trainer_utils", "tensordict",
           "torchrl", "accelerate", "hydra", "omegaconf", "rlhf_train.loop.trainer",
           "rlhf_train.pipeline.stages", "rlhf_train.pipeline.sweep", "rlhf_train.infra.checkpoint")


# --------------------------------------------------------------------------- the server (its own process)
def serve(path: str) -> None:
    """Import :data:`PRELOAD`, listen on the Unix socket ``path``, fork a child per request. The server never
    returns (it exits when the test process is gone); a child returns its request, for ``__main__`` below to
    run outside every server frame."""
    from rlhf_train.infra.cpu_defaults import set_cpu_defaults

    set_cpu_defaults()  # before torch, as rlhf_train/__main__.py does
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    gc.freeze()  # the imported objects: never walked again, in the server or a child
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the client waits for this name: the imports are done
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid -> the connection its exit status goes to
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    parent = os.getppid()
    while os.getppid() == parent:  # the test process is gone (killed): so is the server
        for _ in sel.select(timeout=0.02):
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:  # the child: leave every server frame, keep only its own fds
                sel.close()
                listener.close()
                conn.close()
                _child_fds(fds)
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)  # -N for a child killed by signal N, as Popen reports it
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:
                    pass
                conn.close()
    raise SystemExit(0)


def _child_fds(fds: list[int]) -> None:
    for target, fd in enumerate(fds):  # stdin, stdout, stderr
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)


def run_child(request: dict) -> None:
    """Become ``python -m rlhf_train ARGS`` (in the forked child): the interpreter then exits as that command's
    would (its SystemExit code, 1 with the traceback of an uncaught exception, else 0; atexit handlers run)."""
    import runpy

    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *_BASE_PATH]  # as `python -m` builds it: the cwd, PYTHONPATH, the rest
    sys.argv = ["-m", *request["args"]]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))  # as the interpreter sets up its std streams
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    runpy.run_module("rlhf_train", run_name="__main__", alter_sys=True)


# --------------------------------------------------------------------------- the client (the test process)
_server: tuple[subprocess.Popen, str] | None = None  # this process's server and its socket
_lock = threading.Lock()


def _import_time(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONPATH"))


def _server_path() -> str:
    """The socket of this process's server (started at the first call, with this process's environment)."""
    global _server
    with _lock:
        if _server is None:
            path = os.path.join(tempfile.mkdtemp(prefix="rlhf-zygote-"), "sock")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], cwd=REPO,
                                    env=dict(os.environ), stdin=subprocess.DEVNULL)
            atexit.register(_stop_server)
            _server = (proc, path)
        proc, path = _server
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the test CLI server exited ({proc.returncode}) before listening on {path}")
        time.sleep(0.05)
    return path


def _stop_server() -> None:
    proc, path = _server
    proc.kill()
    proc.wait()
    for name in (path, path + ".tmp"):
        if os.path.exists(name):
            os.unlink(name)
    os.rmdir(os.path.dirname(path))


class ForkedRun:
    """The part of :class:`subprocess.Popen`'s interface the tests use, for a child of the server."""

    def __init__(self, args, *, cwd=None, env=None, stdout=None, stderr=None, text=False, start_new_session=False):
        env = dict(os.environ if env is None else env)
        null = os.open(os.devnull, os.O_RDWR)
        ends, pipes, self._mine = [null], [], []  # the child's stdin/stdout/stderr; write ends; our read ends
        for own, target in ((1, stdout), (2, stderr)):
            if target == subprocess.PIPE:
                r, w = os.pipe()
                ends.append(w)
                pipes.append(w)
                self._mine.append(os.fdopen(r, "r" if text else "rb"))
                continue
            self._mine.append(None)
            if target == subprocess.STDOUT:
                ends.append(ends[1])
            elif target == subprocess.DEVNULL:
                ends.append(null)
            else:  # None: this process's own; else a file object
                ends.append(own if target is None else target.fileno())
        self.stdout, self.stderr = self._mine
        self.args, self.returncode, self._buf = ["-m", "rlhf_train", *args], None, b""
        request = {"args": list(args), "cwd": os.path.abspath(cwd or os.getcwd()), "env": env,
                   "new_session": bool(start_new_session)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server_path())
        socket.send_fds(self._conn, [json.dumps(request).encode()], ends)
        for fd in (null, *pipes):  # the child holds them now: EOF on our read ends when it (and its children) exit
            os.close(fd)
        self.pid = int(self._line(None))

    def _line(self, timeout):
        """The server's next line (the child's pid, then its exit code); TimeoutExpired after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError("the test CLI server closed the connection without an exit code")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self):
        if self.returncode is None:
            try:
                self.wait(0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = int(self._line(timeout))
            self._conn.close()  # the server has said all it will
        return self.returncode

    def communicate(self, timeout=None):
        out = {}

        def read(i, f):
            out[i] = f.read()

        threads = [threading.Thread(target=read, args=(i, f), daemon=True) for i, f in enumerate(self._mine) if f]
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._close()
        return out.get(0), out.get(1)

    def _close(self):
        for f in self._mine:
            if f:
                f.close()

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close()
        self.wait()
        self._conn.close()


def popen(args, **kwargs) -> ForkedRun | subprocess.Popen:
    """``subprocess.Popen([sys.executable, "-m", "rlhf_train", *args], **kwargs)``: forked from the server, or
    that very call where ``env`` gives an import-time variable another value than this process has."""
    if _import_time(kwargs.get("env") or os.environ) != _import_time(os.environ):
        return subprocess.Popen([sys.executable, "-m", "rlhf_train", *args], **kwargs)
    return ForkedRun(list(args), **kwargs)


def run(args, *, capture_output=False, timeout=None, check=False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "rlhf_train", *args], ...)``, forked from the server."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = popen(args, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":  # the server: python tests/helpers/zygote.py SOCKET
    _own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _BASE_PATH = [p for p in sys.path[1:] if p not in _own]  # the interpreter's own entries
    sys.path[0] = REPO  # `rlhf_train` and `tests` importable as in the test process (the repo is its cwd)
    _request = serve(sys.argv[1])
    del serve
    run_child(_request)
