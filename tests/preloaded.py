"""The jobs a test starts, forked from one interpreter that has already imported torch, transformers and DeepSpeed.

Each job a test starts (``conftest.Job``: ``python -m hpcrl trainer RUN``, ...) is a real process killed with real
signals, but importing its libraries is most of a tiny job's CPU (~4 of ~6.5 CPU-s) and the suite starts ~170 of
them on two cores. So this module runs one server per test session (``python tests/preloaded.py SOCKET``) that
imports those libraries once (:data:`PRELOAD`) and forks a job per request; the child then runs the job's command
line as ``python`` would (``runpy``: ``-m MODULE`` or a script, ``sys.argv``, the working directory and the
environment of the request, stdout and stderr to the job's log), and the server reports its exit status as
``subprocess.Popen`` would (a negative signal number when a signal ended it).

A job is forked only when that cannot change what it does (:func:`why_cold`, asked by the server; conftest or the
stand-in starts it cold otherwise): its command line is this Python's own (``python [-u] -m MODULE`` or ``python
[-u] SCRIPT``), its environment equals the server's except variables no preloaded library reads
(:data:`FREE_ENV_PREFIXES`), and its prefix is nothing or the background runs' lowest priority (done in the child).
hpcrl's own modules are never preloaded: each job imports them itself, as a cold one does. ``/proc/PID/cmdline``
shows the job's command line (:func:`_show_command_line`); ``/proc/PID/environ`` shows the server's environment,
which equals the job's but for the free variables (hpcrl reads it for a job's mark and Slurm's and submitit's job
ids, none of them free). The jobs a launcher starts and the commands a test starts itself run the session's
``HPCRL_PYTHON``, a stand-in ``python`` (:func:`as_python`) whose command the server forks the same way. A cold
start is still what every Slurm test and ``tests/test_startup.py`` exercise. The session's last lines say how many
jobs were forked and why the others started cold (an engine made in the test process changes its environment:
``hpcrl/process/environment.py``). ``HPCRL_TEST_COLD_JOBS=1`` starts every job cold (to see whether a failure is
this module's).
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = ("numpy", "yaml", "h5py", "safetensors.torch", "torch", "torch.distributed", "transformers",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.models.qwen2.modeling_qwen2", "transformers.generation.utils", "deepspeed",
           "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "deepspeed.ops.op_builder")
"""What a trainer, rollout or evaluation job imports that costs (hpcrl's own modules are not among them)."""
FREE_ENV_PREFIXES = ("HPCRL_", "TEST_", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "SUBMITIT_", "COLUMNS",
                     "LINES", "GPU_CHECK_")
"""Variables in which a job's environment may differ from the server's: read by hpcrl, the tests' wrappers, pytest,
submitit and ``bench/gpu_check.sh`` (none of them preloaded), or only when used: the cache folder that torch sets in
the test process once inductor's caches are used, the terminal's size (GNU readline puts it into the environment of
a process that imports it, as the test process does: a launcher started with that environment passes it on to its
jobs). ``CUDA_VISIBLE_DEVICES`` (submitit's local jobs set it) too where the server sees no CUDA device: no value can
make one appear; and ``PYTHONPATH`` when none of its folders holds a preloaded package and its ``sitecustomize`` is
the server's (:func:`_shadows_preloaded`): the child puts its folders on ``sys.path`` where a cold start would."""
FREE_ENV_NAMES = ("SHLVL", "_", "TORCH_EXTENSIONS_DIR")
"""Set by every shell for the programs it starts (its depth, the program's path), read by no library; and the folder
of built ops, which torch and hpcrl read when an op is loaded (none is at import: the server loads none)."""
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM)
"""The signals :func:`as_python` passes on to the job it stands for."""
ARGV_ROOM = 4096
"""Bytes of the server's command line that a job's is written over (:func:`_show_command_line`)."""
READY_S = 180.0
"""How long a test waits for the server to finish its imports before it starts its jobs cold."""


def why_cold(argv: list[str], env: dict, server_env: dict, cuda: bool) -> str:
    """Why the server must not fork ``argv`` with ``env`` ('' if it may): not this Python's ``[-u] -m MODULE`` or
    ``[-u] SCRIPT.py`` (the server's own output is unbuffered, as ``-u`` makes it), or an environment that differs
    from the server's (``server_env``) in more than the free variables (``cuda``: the server sees a CUDA device)."""
    args = argv[2:] if argv[1:2] == ["-u"] else argv[1:]
    if not (argv[:1] == [sys.executable] and args and (args[0] == "-m" and len(args) >= 2 or args[0].endswith(".py"))):
        return "another program"

    def comparable(e: dict) -> dict:
        return {k: v for k, v in e.items() if not k.startswith(FREE_ENV_PREFIXES) and k != "PYTHONUNBUFFERED"
                and k not in FREE_ENV_NAMES and (cuda or k != "CUDA_VISIBLE_DEVICES")
                and (k != "PYTHONPATH" or _shadows_preloaded(v, server_env.get("PYTHONPATH", "")))}

    mine, theirs = comparable(server_env), comparable(env)
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    return f"environment differs in {', '.join(differ)}" if differ else ""


def _folders(pythonpath: str) -> list[str]:
    """The folders of a ``PYTHONPATH`` value, absolute, as the interpreter puts them on ``sys.path``."""
    return [os.path.abspath(f) for f in pythonpath.split(os.pathsep) if f]


def _shadows_preloaded(pythonpath: str, server_pythonpath: str) -> bool:
    """A folder of ``pythonpath`` holds a package or module of the same name as a preloaded one (the job would import
    another copy of it), or the ``sitecustomize`` that Python runs at start-up (the server ran the first one on
    ``server_pythonpath``: the tests' CUDA rules) is another one there."""
    def sitecustomize(path: str) -> str:
        return next((str(Path(f, "sitecustomize.py")) for f in _folders(path) if Path(f, "sitecustomize.py").exists()),
                    "")

    tops = {name.split(".")[0] for name in PRELOAD}
    return (any(Path(folder, top).exists() or Path(folder, f"{top}.py").exists()
                for folder in _folders(pythonpath) for top in tops)
            or sitecustomize(pythonpath) != sitecustomize(server_pythonpath))


def _python_path(job_env: dict, server_env: dict) -> list[str]:
    """``sys.path`` as a cold start with ``job_env`` would have it after its first entry: the server's, its own
    ``PYTHONPATH`` folders in place of the server's (the interpreter puts them right after the script's folder)."""
    theirs = _folders(server_env.get("PYTHONPATH", ""))
    rest = sys.path[1 + len(theirs):] if sys.path[1:1 + len(theirs)] == theirs else sys.path[1:]
    return [*_folders(job_env.get("PYTHONPATH", "")), *rest]


# --- the server (its own process) ---------------------------------------------------------------------------------

def _lowest_priority() -> None:
    """What ``conftest.LOWEST_PRIORITY`` does as a prefix: autogroup nice 19, idle I/O class, nice 19."""
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass
    subprocess.run(["ionice", "-c", "3", "-p", str(os.getpid())], check=False)
    os.nice(19)


def autogroup_nice(text: str) -> int | None:
    """The nice value in ``/proc/self/autogroup``'s text (``/autogroup-2035 nice 19``); None where the kernel gives
    none: the file is empty where the process is not in an autogroup (CI's container) and absent without them."""
    words = text.split()
    return int(words[2]) if len(words) == 3 and words[1] == "nice" else None


def _niced_19() -> bool:
    """This process was started as :data:`conftest.LOWEST_PRIORITY` starts one: its autogroup's nice is 19, or,
    where it has no autogroup, its own."""
    try:
        nice = autogroup_nice(Path("/proc/self/autogroup").read_text())
    except OSError:
        nice = None
    return (os.getpriority(os.PRIO_PROCESS, 0) if nice is None else nice) == 19


def _show_command_line(argv: list[str]) -> None:
    """Make ``/proc/self/cmdline`` the job's (``ps``, and the leftover sweep that finds an earlier attempt by its
    command line, see it as a cold job's) by writing it over the server's own, which :data:`ARGV_ROOM` made long
    enough; the rest of that space reads as empty arguments. A longer command line keeps the server's."""
    import ctypes

    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49 of proc(5))
    data = b"".join(a.encode() + b"\0" for a in argv)
    if len(data) <= end - start:
        ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def _run_child(request: dict, fds: list[int], set_by_imports: dict, server_env: dict) -> None:
    """In the forked child: become the job the request describes, then exit as ``python`` would. ``fds``: the
    caller's stdin, stdout and stderr (:func:`as_python`), else its output goes to the request's log;
    ``set_by_imports``: the variables the preloaded imports set where unset (a cold job's own imports set them);
    ``server_env``: the server's own environment (its ``PYTHONPATH`` folders make way for the job's)."""
    import atexit
    import runpy
    import traceback

    if fds:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
    else:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    _show_command_line(request["argv"])
    if request["new_session"]:
        os.setsid()
    if request["lowest_priority"]:
        _lowest_priority()
    for sig in request.get("ignored", ()):  # the caller's ignored and blocked signals, as an exec keeps them
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request.get("blocked", ()))
    os.chdir(request["cwd"])
    os.environ.clear()
    # the job's own variables first, in its order, then what the imports set, as a cold job's own imports add them:
    # a process vLLM spawns finds its command line (setproctitle: VLLM::EngineCore) by walking back from its first
    # environment string, and finds nothing once vLLM has set that variable again (TORCHINDUCTOR_CACHE_DIR was first)
    os.environ.update(request["env"])
    os.environ.update({k: v for k, v in set_by_imports.items() if k not in request["env"]})
    import numpy

    numpy.random.seed()  # numpy's global generator from fresh entropy, as in a new process (Python's reseeds itself)
    argv = [a for i, a in enumerate(request["argv"]) if not (i == 1 and a == "-u")]  # (the server is unbuffered)
    sys.path[1:] = _python_path(request["env"], server_env)
    if argv[1] == "-m":
        sys.argv, sys.path[0] = [argv[2], *argv[3:]], request["cwd"]
    else:
        sys.argv, sys.path[0] = argv[1:], str(Path(argv[1]).resolve().parent)
    code = 0
    try:
        if argv[1] == "-m":
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as python: the traceback, then killed by SIGINT
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # non-daemon threads are joined, then the atexit handlers run, as at a normal exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _exit_as(code)


def _exit_as(code: int) -> None:
    """Exit with ``code`` as ``Popen`` reports it: a negative one by that signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
        time.sleep(1)  # (a stopping signal: it does not end the process)
        code = 128 - code
    os._exit(code & 0xFF)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One JSON line, and the file descriptors that came with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    if not data.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the client went away")
    return json.loads(data), list(fds)


def serve(path: str) -> None:
    """Import :data:`PRELOAD`, then fork one job per connection: the request (one JSON line, with the caller's
    stdin, stdout and stderr from :func:`as_python`) in, the child's pid out (or ``cold WHY``: :func:`why_cold`),
    and its exit status once it has ended. A ``tied`` job is SIGKILLed when its caller's connection closes before
    it ended (the caller was killed). Each decision is a line of ``PATH.started`` (:meth:`Preloaded.summary`).
    Single-threaded (a fork of a threaded process is unsafe): the children's ends are noticed through SIGCHLD
    written to a pipe that ``select`` watches with the listener and the tied connections."""
    import importlib

    server_env = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # (numpy's OpenBLAS starts a native pool: it stops and restarts it at fork)
        raise SystemExit(f"preloaded: the imports started threads {threading.enumerate()}; forking is unsafe")
    import torch

    cuda = torch.cuda.is_available()  # (DeepSpeed's import has already asked)
    set_by_imports = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    children: dict[int, socket.socket] = {}
    tied: dict[socket.socket, int] = {}
    with open(path + ".started", "a", buffering=1) as started:
        while True:
            ready, _, _ = select.select([listener, wake_r, *tied], [], [])
            if wake_r in ready:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                _reap(children, tied)
            for conn in [c for c in ready if c in tied]:
                if not conn.recv(1):  # its caller is gone: the job goes too
                    os.kill(tied.pop(conn), signal.SIGKILL)
            if listener not in ready:
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (ConnectionError, ValueError):
                conn.close()
                continue
            why = why_cold(request["argv"], request["env"], server_env, cuda)
            started.write(f"{why or 'forked'}\n")
            if why:  # the caller's stdin, stdout and stderr are not kept: its reader would wait for their end forever
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"cold {why}\n".encode())
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                for s in (listener, conn, *children.values()):
                    s.close()
                os.close(wake_r)
                os.close(wake_w)
                _run_child(request, fds, set_by_imports, server_env)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            if request.get("tied"):
                tied[conn] = pid
            conn.sendall(f"{pid}\n".encode())


def _reap(children: dict[int, socket.socket], tied: dict[socket.socket, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            tied.pop(conn, None)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the test that started it has gone
            conn.close()


# --- the clients: a test's job (conftest.Job), and a ``python`` that a launcher's job runs -------------------------

class ForkedJob:
    """A forked job as ``subprocess.Popen`` shows one: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``."""

    def __init__(self, conn: socket.socket, args: list[str], pid: int):
        self._conn, self.args, self.returncode, self.pid = conn, args, None, pid
        self._got = b""  # what the server sent past the last whole line (its pid and status may come in one read)

    @classmethod
    def start(cls, path: str, request: dict, fds: list[int] = ()) -> ForkedJob | str:
        """Send ``request`` (and ``fds``) to the server at ``path``: the forked job, or why it must start cold."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        data = (json.dumps(request) + "\n").encode()
        socket.send_fds(conn, [data], list(fds)) if fds else conn.sendall(data)
        job = cls(conn, request["argv"], 0)
        first = job._line(None).decode()
        if first.startswith("cold "):
            conn.close()
            return first[5:]
        job.pid = int(first)
        return job

    def _line(self, timeout: float | None) -> bytes | None:
        """The server's next line, waiting at most ``timeout`` s (None: for ever); None if none came in time."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._got:
            if not select.select([self._conn], [], [], None if end is None else max(end - time.monotonic(), 0))[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise ConnectionError(f"the preloaded server went away while {self.args} ran")
            self._got += chunk
        line, self._got = self._got.split(b"\n", 1)
        return line

    def _status(self, timeout: float | None) -> bool:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                return False
            self.returncode = int(line)
            self._conn.close()
        return True

    def poll(self):
        self._status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _wait_for_server(path: str, server_pid: int) -> bool:
    """The server's socket exists, waiting (at most :data:`READY_S`) while the server still imports."""
    end = time.monotonic() + READY_S
    while not os.path.exists(path) and os.path.exists(f"/proc/{server_pid}") and time.monotonic() < end:
        time.sleep(0.05)
    return os.path.exists(path)


def as_python(path: str, server_pid: int, args: list[str]) -> None:
    """``python ARGS`` for the jobs a launcher starts (``HPCRL_PYTHON`` in the tests, :meth:`Preloaded.python`):
    the server forks the job when :func:`why_cold` allows, with this process's stdin, stdout, stderr, working
    directory, environment, blocked and ignored signals and priority; this process stays its stand-in for whoever
    started it (submitit's controller): the signals it gets go on to the job, the job's exit status becomes its
    own, and if it is SIGKILLed the server SIGKILLs the job. Otherwise this Python runs ARGS itself (``exec``)."""
    argv, pending = [sys.executable, *args], []
    # every signal is passed on, one ignored here too: the job ignores it as well (an exec keeps it ignored) unless it
    # handles it itself (a launcher under a shell that ignores Ctrl-C); one before the job's pid is known, once it is
    ignored = [s for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    lowest = _niced_19()
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "tied": True, "new_session": lowest,
               "lowest_priority": lowest, "ignored": ignored,
               "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}
    try:
        job = ForkedJob.start(path, request, [0, 1, 2]) if _wait_for_server(path, server_pid) else "no server"
    except (OSError, ConnectionError) as e:
        job = f"no server ({e})"
    if isinstance(job, str):
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        os.execv(sys.executable, argv)

    def forward(signum, frame):
        try:
            os.kill(job.pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for sig in pending:
        forward(sig, None)
    try:
        code = job.wait()
    except ConnectionError as e:
        print(f"preloaded: {e}", file=sys.stderr)
        code = 1
    _exit_as(code)


class Preloaded:
    """The session's server, started at the first job (in the background: a test does not wait for it unless it
    starts a job); :meth:`start` forks a job or returns None (start it cold); :attr:`python` is a ``python`` whose
    jobs the server forks (:func:`as_python`)."""

    def __init__(self, folder: Path):
        self.path = str(folder / "preloaded.sock")
        self._env = dict(os.environ)
        self.log = folder / "preloaded.out"
        room = "-" * ARGV_ROOM  # the space a job's command line is written into
        self.proc = subprocess.Popen([sys.executable, "-u", __file__, self.path, room], stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT, env=self._env)
        self._usable: bool | None = None
        self._prefixed = 0
        """Jobs started cold for their prefix (the server counts the rest)."""
        self._lock = threading.Lock()
        self.python = folder / "python"
        self.python.write_text(f"#!/bin/sh\nexec {sys.executable} -S {__file__} --python {self.path} "
                               f"{self.proc.pid} \"$@\"\n")
        self.python.chmod(0o755)

    def summary(self) -> str:
        """One line: how many jobs were forked and why the others started cold ('' if no test started one)."""
        try:
            lines = Path(self.path + ".started").read_text().splitlines()
        except OSError:
            lines = []
        counts = {why: lines.count(why) for why in set(lines)}
        if self._prefixed:
            counts["a prefix"] = self._prefixed
        if not counts:
            return ""
        cold = sorted(((n, why) for why, n in counts.items() if why != "forked"), reverse=True)
        return (f"preloaded jobs: {counts.get('forked', 0)} forked, {sum(n for n, _ in cold)} cold"
                + "".join(f"; {n}: {why}" for n, why in cold))

    def _ready(self) -> bool:
        """Wait (at most :data:`READY_S`) for the server's socket; False (and a line saying why) if it died."""
        with self._lock:
            if self._usable is None:
                self._usable = _wait_for_server(self.path, self.proc.pid)
                if not self._usable:
                    print(f"preloaded: no server ({self.log}: {self.log.read_text(errors='replace')[-2000:]}); "
                          "jobs start cold", file=sys.stderr)
            return self._usable

    def start(self, argv: list[str], env: dict, cwd: Path, log: Path, new_session: bool, lowest_priority: bool,
              prefixed: bool) -> ForkedJob | None:
        """The job forked, or None: start it cold (``prefixed``: it runs under a prefix the server cannot apply)."""
        if prefixed:
            self._prefixed += 1
            return None
        if not self._ready():
            return None
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log), "new_session": new_session,
                   "lowest_priority": lowest_priority}
        job = ForkedJob.start(self.path, request)
        return None if isinstance(job, str) else job

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    if sys.argv[1] == "--python":
        as_python(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        serve(sys.argv[1])
