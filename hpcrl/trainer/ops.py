"""DeepSpeed's JIT-built ops: where they are built, and a build that can neither hang a job nor poison later
ones.

DeepSpeed compiles some ops with gcc the first time a process needs them (on CPU: ``deepspeed_shm_comm``,
which its communication backend loads at ``init_distributed``), through torch's extension loader. That
loader guards a build with a ``lock`` file in the op's folder; a process that finds the file polls, with
no deadline and no log line, until it disappears. A trainer killed mid-build (SIGKILL, Ctrl-C, a
preemption) leaves the file behind and every later trainer using the folder sleeps there forever; its
compiler processes lived on as orphans. So, before DeepSpeed starts:

1. **One folder per node and environment**: ``TORCH_EXTENSIONS_DIR`` is set to
   ``~/.cache/hpcrl/torch_extensions/<host>-<env>/`` (``<env>``: a hash of the interpreter, torch and
   DeepSpeed versions), unless the user set it. DeepSpeed builds with ``-march=native``, so a build is
   only reused on the node that made it; ``install.sh`` builds it for the node it runs on.
2. **Stale locks are removed**: every hpcrl process holds an exclusive ``flock`` on
   ``<folder>/.hpcrl-build.lock`` (the kernel releases it when the process dies, however it dies) while it
   builds or loads ops there; holding it, any ``lock`` file left in the folder belongs to a dead build,
   and is removed with a log line naming it.
3. **A build is ready when its record says so**: after a build finishes, ``<folder>/<op>/hpcrl-built.json``
   records what it was built from (:func:`build_inputs`: the sources' contents, the compiler and its flags,
   the include paths) and the size and time of the ``.so`` it made. An op whose record matches is loaded from
   its ``.so`` directly (:func:`load_built`), without torch's loader, whose ninja may decide to compile again
   (a cancelled build's compilers that outlived ninja left ``shm.o`` newer than ninja's logs: "stored deps info
   out of date"; a user saw each start of a session spend 2-3 minutes there, inside the trainer and beyond the
   reach of item 4). ``hpcrl build-ops`` and the trainer decide with the same record, so an op build-ops
   calls ready is never compiled at a trainer's start.
4. **Every build runs in a session of its own** (``python -m hpcrl.trainer.ops``), with one line saying why
   (no record, the inputs changed, the ``.so`` changed): the session dies with the trainer (Linux
   parent-death signal; then every process of the session is killed and waited for: ninja puts each compiler
   in a process group of its own, the session holds them all), bounded by the start-up step's deadline. The
   record is removed before the build starts and written after it ends well, so a cancelled build is built
   again at the next start.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hpcrl.process import faults, termination
from hpcrl.process.pids import pid_running

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
"""The file torch's extension loader creates in an op's folder while it builds (its ``FileBaton``)."""
OUR_LOCK = ".hpcrl-build.lock"
"""The file hpcrl processes ``flock`` while they build or load ops in the folder."""
RECORD_NAME = "hpcrl-built.json"
"""In an op's folder: what its finished build was made from and the ``.so`` it made (module docstring, 3)."""
POLL_S = 0.2
GONE_S = 10.0
"""How long :func:`kill_session` waits for the killed processes of a build to be gone."""


def extensions_dir() -> Path:
    """Where torch builds and finds extensions for this process: ``TORCH_EXTENSIONS_DIR`` if set, else hpcrl's
    folder for this node and environment (set into the environment, so DeepSpeed uses it)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    folder = node_extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    return folder


def node_extensions_dir() -> Path:
    """hpcrl's folder of built ops for this node and environment (module docstring, 1)."""
    import deepspeed
    import torch

    env = f"{sys.prefix}|{sys.version}|{torch.__version__}|{deepspeed.__version__}"
    key = f"{socket.gethostname()}-{hashlib.sha1(env.encode()).hexdigest()[:10]}"
    return Path.home() / ".cache" / "hpcrl" / "torch_extensions" / key


def ops_to_build() -> list:
    """The op builders DeepSpeed will JIT-load in a trainer here: the CPU accelerator's shared-memory
    communication op (its torch backend loads it at start); none on GPUs (hpcrl's optimizer is torch's)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _cuda() else "cpu")
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    return [builder]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@contextmanager
def build_lock(folder: Path, deadline_s: float) -> Iterator[None]:
    """Hold the folder's ``flock`` (waiting at most ``deadline_s``, saying who holds it); holding it, remove the
    ``lock`` files that dead builds left."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / OUR_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, folder, deadline_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        for stale in sorted(folder.glob(f"*/{LOCK_NAME}")):
            log.warning("removed %s: a build killed before it finished left it (no process holds %s), and torch "
                        "would wait for it forever", stale, folder / OUR_LOCK)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, folder: Path, deadline_s: float) -> None:
    end, said = time.monotonic() + deadline_s, 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise OSError(e.errno, f"flock on {folder / OUR_LOCK} failed ({e.strerror}); put "
                                       "TORCH_EXTENSIONS_DIR on a filesystem with locks (node-local disk)") from None
        now = time.monotonic()
        if now > end:
            raise TimeoutError(f"another process held {folder / OUR_LOCK} for {deadline_s:.0f}s "
                               f"({_holder(folder)})")
        if now - said >= 10.0:
            log.info("waiting for %s (held by %s: building DeepSpeed's ops there)", folder / OUR_LOCK, _holder(folder))
            said = now
        termination.check()
        time.sleep(POLL_S)


def _holder(folder: Path) -> str:
    try:
        return (folder / OUR_LOCK).read_text().strip() or "?"
    except OSError:
        return "?"


def _library(folder: Path, name: str) -> Path:
    return folder / name / f"{name}.so"


def build_inputs(builder) -> dict:
    """What a build of ``builder``'s op is made from, as DeepSpeed's JIT load hands it to torch (its sources with a
    hash of their contents, include paths, compiler flags, link flags) and the compiler torch runs."""
    sources = [os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.strip_empty_entries(builder.sources())]
    digests = {}
    for path in sources:
        with open(path, "rb") as f:
            digests[path] = hashlib.sha256(f.read()).hexdigest()
    return {"sources": digests,
            "include_paths": [os.path.abspath(builder.deepspeed_src_path(p))
                              for p in builder.strip_empty_entries(builder.include_paths())],
            "cxx_args": builder.strip_empty_entries(builder.cxx_args()) + ["-UC10_USE_GLOG"],
            "ldflags": builder.strip_empty_entries(builder.extra_ldflags()),
            "compiler": os.environ.get("CXX", "c++")}


def _library_stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def stale_reason(folder: Path, builder) -> str | None:
    """Why op ``builder`` in ``folder`` must be built before it is loaded, or None: its record matches what it
    would be built from now and the ``.so`` it made (module docstring, 3). ``hpcrl build-ops`` and the trainer both
    ask this."""
    name = builder.NAME
    if not _library(folder, name).is_file():
        return "it is not built yet"
    try:
        record = json.loads((folder / name / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return (f"no record of a finished build ({RECORD_NAME}: the last build was cancelled, or made before "
                "hpcrl kept one)")
    if not isinstance(record, dict) or record.get("inputs") != build_inputs(builder):
        return "its sources, compiler or flags changed since it was built"
    if record.get("library") != _library_stat(_library(folder, name)):
        return f"{_library(folder, name).name} changed after the build that made it (another process wrote it)"
    return None


def load_built(folder: Path, builder):
    """Load op ``builder`` from its ``.so`` in ``folder`` and hand it to DeepSpeed (whose own load then returns it),
    without torch's loader and its ninja: nothing is compiled here."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    name = builder.NAME
    spec = importlib.util.spec_from_file_location(name, _library(folder, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    OpBuilder._loaded_ops[name] = module
    return module


def prepare_ops(deadline_s: float) -> list[str]:
    """Build what is not ready (in a child session, :func:`stale_reason` saying why) and load the ops DeepSpeed will
    need, in this node's folder; the names loaded. TimeoutError naming the op and the folder past ``deadline_s``."""
    builders = ops_to_build()
    if not builders:
        return []
    folder = extensions_dir()
    end = time.monotonic() + deadline_s
    with build_lock(folder, deadline_s):
        for b in builders:
            why = stale_reason(folder, b)
            if why is not None:
                (folder / b.NAME / RECORD_NAME).unlink(missing_ok=True)
                _build_in_child(b.NAME, folder, end - time.monotonic(), why)
                _write_record(folder, b)
            load_built(folder, b)  # in this process: DeepSpeed's own init finds it loaded
    return [b.NAME for b in builders]


def _write_record(folder: Path, builder) -> None:
    path = folder / builder.NAME / RECORD_NAME
    record = {"inputs": build_inputs(builder), "library": _library_stat(_library(folder, builder.NAME)),
              "built_s": time.time()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _build_in_child(name: str, folder: Path, timeout_s: float, why: str) -> None:
    log.info("building DeepSpeed's op %s in %s because %s (once per node and environment; a minute or two on a "
             "few cores)", name, folder, why)
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "hpcrl.trainer.ops", name, str(os.getpid())],
                             start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        while child.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"building DeepSpeed's op {name} in {folder} took longer than {timeout_s:.0f}s")
            termination.check()
            time.sleep(POLL_S)
    finally:
        if child.poll() is None:
            kill_session(child.pid)  # started with start_new_session: its pid is the session's id
    if child.returncode != 0:
        raise RuntimeError(f"building DeepSpeed's op {name} in {folder} failed (exit {child.returncode}; its "
                           "compiler output is above)")
    log.info("built DeepSpeed's op %s in %.0fs", name, time.monotonic() - t0)


def _session_members(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (from ``/proc``; ninja runs each compiler in a process group of
    its own, but all stay in the build's session)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the build and everything it started), the caller last if in it;
    then wait (at most :data:`GONE_S`) until none of them runs: a compiler must not write into the op's folder
    after its build was cancelled."""
    me = os.getpid()
    members = sorted(_session_members(sid), key=lambda p: p == me)
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + GONE_S
    while any(pid_running(p) for p in members if p != me) and time.monotonic() < end:
        time.sleep(0.02)


PR_SET_PDEATHSIG = 1


def _child(name: str, parent: int) -> int:
    """The build process: dies with its parent (parent-death signal -> kill its whole session), builds ``name``."""
    signal.signal(signal.SIGTERM, lambda *_: kill_session(os.getsid(0)))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the trainer's own reaper is all there is
    if os.getppid() != parent:  # the trainer died before the signal was armed
        return 1
    faults.point("op_build")
    builder = next(b for b in ops_to_build() if b.NAME == name)
    builder.load(verbose=False)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2])))
