"""Workers forked from a warm interpreter: torch, transformers and peft imported once, not once a worker.

Each worker used to be a fresh ``python -m`` process that spent seconds importing the same libraries
before its first statement (on a 2-core machine, most of a small run). Now one *starter* process per
launching process does those imports once, with the environment a fresh worker would start with,
and forks each worker from there; a later run from the same process (a notebook, a script, the test
suite) reuses it while that environment is the same, and a changed environment starts a new one.

What stays as it was: the elastic agent still starts one process per rank, a tiny client
(``CLIENT``, the standard library only) that hands its file descriptors, environment, working
directory and ``-m MODULE ARGS`` to the starter, forwards the signals it gets to the worker and ends
with the worker's exit status, so the agent's signals, exit codes and error files work unchanged. A
worker reads what a fresh one reads at start (glibc's tunables, OpenMP's thread count, unbuffered
output) because the starter started with it, and the output the imports printed is written again
at the top of each worker's own output, as a fresh worker would print it.

Death: the starter ends when its launcher does (the end of a pipe only the launcher holds), killing
the workers it forked; a worker dies with the starter (``distributed.die_with_parent``), and the
starter kills a worker whose client is gone (the agent's SIGKILL).

CUDA: a forked process cannot use a CUDA driver its parent initialised. A starter whose imports
loaded the driver (a library that asked for the GPUs at import) says so, and execs a fresh
``python -m`` in each fork instead (the old start-up, no faster, never broken).

``SHARDTUNE_WORKER_START=fresh`` starts every worker as a fresh process, without a starter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

from shardtune.runtime.failure import FAIL_AT

START_ENV = "SHARDTUNE_WORKER_START"
#: Set by our launcher for its workers, as "PID:RUN_ID": the process whose death must end them (the launcher,
#: or the starter a worker was forked from, which ends with the launcher). distributed.die_with_parent reads it.
LAUNCHER_PID = "SHARDTUNE_LAUNCHER_PID"

#: What the starter imports before it forks: the libraries every training or eval worker imports. A module
#: that fails to import is skipped; the worker that needs it fails on its own, with its own message.
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils", "peft",
           "shardtune.train.recipe")


START_MODES = ("warm", "fresh")


def warm() -> bool:
    """Whether workers are forked from a starter (the default) rather than started fresh."""
    mode = os.environ.get(START_ENV, "warm") or "warm"
    if mode not in START_MODES:
        from shardtune.config import ConfigError

        raise ConfigError(f"{START_ENV}={mode!r} is not one of {', '.join(START_MODES)}")
    return mode == "warm"


# ---- the client: what the agent runs for each rank (kept to the standard library: it starts in milliseconds)

CLIENT = r"""
import json, os, signal, socket, sys, time
address, extra = "\0" + sys.argv[1], json.loads(sys.argv[2])
env = dict(os.environ); env.update(extra)
body = json.dumps({"env": env, "cwd": os.getcwd(), "argv": sys.argv[3:]}).encode()
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(address)
except OSError as err:
    print(f"error: cannot reach the process that starts shardtune's workers: {err}", file=sys.stderr)
    os._exit(1)
socket.send_fds(s, [len(body).to_bytes(8, "big")], [0, 1, 2])
s.sendall(body)
replies = s.makefile("rb")
started = replies.readline().split()
if not started:
    print("error: the process that starts shardtune's workers ended before this one started", file=sys.stderr)
    os._exit(1)
pid = int(started[1])
def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
ended = replies.readline().split()
if not ended:
    print("error: the process that starts shardtune's workers ended, and this worker with it", file=sys.stderr)
    os._exit(1)
kind, value = ended[0], int(ended[1])
if kind == b"signal":  # end by the same signal (SIGKILL and SIGSTOP take no handler)
    if value not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(value, signal.SIG_DFL)
    os.kill(os.getpid(), value)
    time.sleep(1)
os._exit(value)
"""


# ---- the starter process

def serve(name: str, alive_fd: int, ready_fd: int, output_dir: str, preload: tuple[str, ...] = PRELOAD,
          fresh: bool | None = None) -> None:
    """The starter's main loop: listen at the abstract socket ``name`` (no file: no path length limit, nothing
    to clean up), say so on ``ready_fd``, import ``preload``, then fork a worker for each client that connects.
    ``fresh``: exec a fresh interpreter in each fork (default: where the imports loaded the CUDA driver)."""
    import importlib
    import selectors

    if sys.path and sys.path[0] == "":  # ``python -c``'s working directory; each worker gets its own
        sys.path.pop(0)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0" + name)  # clients may connect from now on; they wait in the backlog until the imports end
    listener.listen(64)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - see PRELOAD
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    printed = {fd: open(os.path.join(output_dir, f"{fd}.log"), "rb").read() for fd in (1, 2)}  # noqa: SIM115
    fresh = _cuda_driver_loaded() if fresh is None else fresh

    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(alive_fd, selectors.EVENT_READ, "alive")
    sel.register(wakeup_r, selectors.EVENT_READ, "child")
    workers: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        for key, _ in sel.select():
            if key.data == "alive":  # the launcher is gone (or let us go): so are its workers
                for pid in workers:
                    _kill(pid)
                os._exit(0)
            elif key.data == "child":
                os.read(wakeup_r, 4096)
                _reap(workers, sel)
            elif key.data == "listen":
                conn, _ = listener.accept()
                pid = _fork_worker(conn, printed, fresh, closing=[sel.fileno(), listener.fileno(), alive_fd,
                                                               wakeup_r, wakeup_w,
                                                               *(c.fileno() for c in workers.values())])
                if pid:
                    workers[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
            elif key.data in workers:  # a client's connection ended: the agent killed it, so kill its worker
                if not key.fileobj.recv(1):
                    _kill(key.data)
                    sel.unregister(key.fileobj)


def _cuda_driver_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return True  # cannot tell: never fork over an unknown driver state


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(workers: dict[int, socket.socket], sel) -> None:
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is None:
            continue
        reply = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                 else f"exit {os.waitstatus_to_exitcode(status)}")
        try:
            conn.sendall(reply.encode() + b"\n")
        except OSError:
            pass
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(30)
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size = int.from_bytes(head, "big")
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client left before its request was read")
        body += chunk
    conn.settimeout(None)
    return json.loads(body), fds


def _fork_worker(conn: socket.socket, printed: dict[int, bytes], fresh: bool, closing: list[int]) -> int:
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError, ConnectionError):
        conn.close()
        return 0
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"pid {pid}\n".encode())
        except OSError:  # the client is gone already (stopped while this process was still importing)
            _kill(pid)
            conn.close()
            return 0
        return pid
    try:
        _become_worker(request, fds, printed, fresh, closing + [conn.fileno()])
    except SystemExit as stop:  # as the interpreter ends on it: a number is the code, anything else is printed
        if stop.code is None or isinstance(stop.code, int):
            _leave(stop.code or 0)
        print(stop.code, file=sys.stderr)
        _leave(1)
    except BaseException:  # noqa: BLE001 - what ``python -m`` does with an uncaught exception
        import traceback

        traceback.print_exc()
        _leave(1)
    _leave(0)
    return 0  # not reached


def _become_worker(request: dict, fds: list[int], printed: dict[int, bytes], fresh: bool,
                   closing: list[int]) -> None:
    import runpy

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in closing:
        try:
            os.close(fd)
        except OSError:
            pass
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    if LAUNCHER_PID in env:  # the process whose death ends this worker is now this starter
        env[LAUNCHER_PID] = f"{os.getppid()}:{env[LAUNCHER_PID].partition(':')[2]}"
    os.environ.clear()
    os.environ.update(env)
    argv = request["argv"]
    if fresh or argv[:1] != ["-m"]:
        os.execve(sys.executable, [sys.executable, *argv], env)
    if "RANK" in env:  # what ``ps`` and ``top`` show: every fork would otherwise show the starter's command
        _name_process(f"shardtune r{env['RANK']}")
    for fd, text in printed.items():  # what the imports printed, as a fresh worker prints it
        if text:
            os.write(fd, text)
    sys.path.insert(0, request["cwd"])  # as ``python -m`` puts it
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


def _name_process(name: str) -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _leave(code: int) -> None:
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# ---- the launcher's side

class _Starter:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD, fresh: bool | None = None) -> None:
        import select
        import subprocess
        import tempfile
        import uuid

        self.env = env
        self.dir = tempfile.mkdtemp(prefix="shardtune-start-")  # what the imports print
        self.address = f"shardtune-start-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        alive_r, self.alive_w = os.pipe()
        ready_r, ready_w = os.pipe()
        outputs = [open(os.path.join(self.dir, f"{fd}.log"), "wb") for fd in (1, 2)]  # noqa: SIM115
        code = (f"from shardtune.runtime.warm_start import serve; serve({self.address!r}, {alive_r}, {ready_w}, "
                f"{self.dir!r}, {tuple(preload)!r}, {fresh!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=[alive_r, ready_w],
                                     stdin=subprocess.DEVNULL, stdout=outputs[0], stderr=outputs[1],
                                     start_new_session=True)  # a terminal's Ctrl-C goes to the launcher only
        for fd in (alive_r, ready_w):
            os.close(fd)
        for f in outputs:
            f.close()
        try:
            ready = select.select([ready_r], [], [], 120)[0] and os.read(ready_r, 1)
        finally:
            os.close(ready_r)
        if not ready:
            err = open(os.path.join(self.dir, "2.log")).read()  # noqa: SIM115
            self.stop()
            raise RuntimeError("the process that starts shardtune's workers did not start (SHARDTUNE_WORKER_START"
                               f"=fresh starts each worker on its own):\n{err[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        import shutil
        import subprocess

        try:
            os.close(self.alive_w)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_starter: _Starter | None = None
_LOCK = threading.Lock()


#: Variables a starter's environment is not compared on: read when used, never at start or import, so a
#: starter with or without them (or with other values) serves alike; each worker gets the launcher's own
#: values with the rest of its environment. Libraries set the first two in a process's os.environ the first
#: time they need them (torch's compiler, to the default it would use anyway), so a launcher gains them during
#: its first run; pytest sets the third for each test it runs (a suite that runs fine-tunes, shardtune's own);
#: the last is read only where a stage of the run begins (runtime/failure.py), for the tests that inject faults.
NOT_READ_AT_START = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTEST_CURRENT_TEST", FAIL_AT)


def same_start(env: dict[str, str]) -> dict[str, str]:
    """``env`` as starters are compared on: two environments equal here start the same process."""
    return {k: v for k, v in env.items() if k not in NOT_READ_AT_START}


def starter_address(env: dict[str, str]) -> str:
    """The socket of a starter whose environment is ``env`` (the launcher's, with what workers add): the
    running one, or a new one in its place."""
    global _starter
    with _LOCK:
        if _starter is not None and (same_start(_starter.env) != same_start(env) or not _starter.alive()):
            _starter.stop()
            _starter = None
        if _starter is None:
            _starter = _Starter(env)
        return _starter.address


def client_command(address: str, env: dict[str, str], module: str, args: list[str]) -> tuple[str, list[str]]:
    """(entrypoint, arguments) of the client that has the starter fork ``python -m module *args`` with ``env``
    added to the client's environment."""
    return sys.executable, ["-c", CLIENT, address, json.dumps(env), "-m", module, *args]
