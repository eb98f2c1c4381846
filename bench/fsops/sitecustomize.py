"""Counts a process's filesystem operations on one run directory (``bench/bench_scale.py`` only).

Python imports ``sitecustomize`` at start-up when its folder is on ``PYTHONPATH``; the benchmark puts this
folder there for the launcher and every job it starts. Inert unless ``HPCRL_FSOPS_RUN`` (the run directory)
and ``HPCRL_FSOPS_OUT`` (a folder for the counts) are set. It counts, for paths under the run directory,
Python's audit events (files opened for reading / for writing, directory listings, renames, removals,
mkdirs) and calls of ``os.stat`` and ``os.fsync`` (fsyncs of any file: a job fsyncs only the run directory's);
the bytes a process wrote to storage come from ``/proc/self/io``. Every 2 s and at exit it rewrites
``HPCRL_FSOPS_OUT/<pid>.json``. HDF5's own C-level opens are not seen (hpcrl reads and writes shard bytes
from Python, so those are). With ``HPCRL_FSOPS_SITES=1`` each operation is also counted under the innermost
``hpcrl`` function that caused it (``sites`` in the row: ``"op file:function" -> count``), to find what to cut.
"""
import atexit
import json
import os
import sys
import threading
import time

_RUN = os.environ.get("HPCRL_FSOPS_RUN")
_OUT = os.environ.get("HPCRL_FSOPS_OUT")
_SITES = os.environ.get("HPCRL_FSOPS_SITES") == "1"

if _RUN and _OUT:
    _counts = {"open_read": 0, "open_write": 0, "listdir": 0, "rename": 0, "remove": 0, "mkdir": 0, "stat": 0,
               "fsync": 0}
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    _sites: dict = {}

    def _count(op: str) -> None:
        _counts[op] += 1
        if not _SITES:
            return
        f = sys._getframe(2)
        while f is not None and "/hpcrl/" not in f.f_code.co_filename:
            f = f.f_back
        where = "?" if f is None else (f"{f.f_code.co_filename.rsplit('/hpcrl/', 1)[1]}:{f.f_code.co_name}")
        key = f"{op} {where}"
        _sites[key] = _sites.get(key, 0) + 1

    def _ours(path) -> bool:
        try:
            return os.fspath(path).startswith(_RUN) if not isinstance(path, int) else False
        except TypeError:
            return False

    def _hook(event, args):
        if event == "open" and args and _ours(args[0]):
            mode, flags = args[1], args[2] or 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _WRITE)
            _count("open_write" if writes else "open_read")
        elif event in ("os.listdir", "os.scandir") and args and _ours(args[0]):
            _count("listdir")
        elif event == "os.rename" and args and _ours(args[0]):
            _count("rename")
        elif event in ("os.remove", "os.rmdir") and args and _ours(args[0]):
            _count("remove")
        elif event == "os.mkdir" and args and _ours(args[0]):
            _count("mkdir")

    sys.addaudithook(_hook)
    _fsync, _stat = os.fsync, os.stat

    def _counted_fsync(fd):
        _count("fsync")
        return _fsync(fd)

    def _counted_stat(path, *a, **k):
        if _ours(path):
            _count("stat")
        return _stat(path, *a, **k)

    os.fsync, os.stat = _counted_fsync, _counted_stat

    def _dump():
        try:
            with open("/proc/self/io") as f:
                io = dict(line.split(": ") for line in f.read().splitlines())
            row = {**_counts, "write_bytes": int(io.get("write_bytes", 0)), "wchar": int(io.get("wchar", 0)),
                   "argv": " ".join(sys.argv)[-200:], "pid": os.getpid(), "sites": dict(_sites)}
            tmp = os.path.join(_OUT, f".{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump(row, f)
            os.replace(tmp, os.path.join(_OUT, f"{os.getpid()}.json"))
        except Exception:  # noqa: BLE001 - counting must never break a job
            pass

    def _loop():
        while True:
            time.sleep(2.0)
            _dump()

    threading.Thread(target=_loop, name="fsops", daemon=True).start()
    atexit.register(_dump)
