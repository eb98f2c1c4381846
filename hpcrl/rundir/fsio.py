"""Crash-safe file primitives: every file another job reads goes through here.

Two patterns only (ARCHITECTURE.md, "Invariants"):
- whole files: write ``x.tmp`` -> fsync -> ``os.replace(x.tmp, x)`` -> fsync the folder;
- append-only logs: one JSON object per line, each ``write`` + ``fsync``; a reader
  skips a last line without its newline (the writer died mid-line). A log named ``*.gz`` holds the same lines
  compressed, one gzip member per append (``zcat`` and pandas read it as one file): a member cut short by a
  killed writer reads as the lines it holds, the last one torn, as in a plain log.

Every write also survives a misbehaving filesystem (:mod:`hpcrl.rundir.disk`: :func:`~hpcrl.rundir.disk.guarded`).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from hpcrl.rundir.disk import guarded, make_dirs

log = logging.getLogger(__name__)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def fsync_path(path: os.PathLike | str) -> None:
    """fsync a file, or a folder (which makes a rename or a new entry in it durable), by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: os.PathLike | str) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_file_durably(path: os.PathLike | str, data: bytes, what: str = "a file") -> None:
    """Create ``path`` holding exactly ``data``, fsync'd (the caller renames it into place); a failed try removes it
    (:func:`~hpcrl.rundir.disk.guarded`)."""
    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    guarded(what, path, len(data), write, undo=lambda: _unlink(Path(path)))


def truncate_torn_tail(path: os.PathLike | str) -> int:
    """Cut a JSONL file back to its last newline; return the bytes removed.

    For the one writer of an append-only log, before it appends again: a tail
    without its newline was left by a writer killed mid-line, and no reader ever
    counted it (readers take complete lines only). Ending it with a newline instead
    would turn a fragment that happens to be complete JSON into a record nobody
    committed.
    """
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            pos = size
            while pos > 0:
                step = min(pos, 1 << 16)
                f.seek(pos - step)
                chunk = f.read(step)
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    keep = pos - step + nl + 1
                    break
                pos -= step
            else:
                keep = 0
            if keep < size:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
            return size - keep
    except FileNotFoundError:
        return 0


def write_bytes_atomic(path: os.PathLike | str, data: bytes, wait: bool = True) -> None:
    """Write ``data`` to ``path`` as tmp -> fsync -> replace -> fsync the folder: never torn, the tmp removed if a
    try fails (:func:`~hpcrl.rundir.disk.guarded`; ``wait`` False: a full disk raises at once)."""
    path = Path(path)
    # one tmp name per process and thread: two threads writing the same file must not share (and rename) one
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")

    def write() -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    guarded("a file", path, len(data), write, undo=lambda: _unlink(tmp), wait=wait)


def write_json_atomic(path: os.PathLike | str, obj: Any, wait: bool = True) -> None:
    """:func:`write_bytes_atomic` of ``obj`` as indented, sorted JSON."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), wait=wait)


def read_json(path: os.PathLike | str) -> Optional[Any]:
    """The JSON in ``path``, or None if it does not exist (atomic writes: never torn)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


class JsonlAppender:
    """Append JSON lines durably (write + fsync per call) to one file; to a ``*.gz`` file as one gzip member per call.

    One writer per file. A crash can leave at most the last line incomplete, which :func:`read_jsonl` skips; a
    write that fails (a full disk: :func:`~hpcrl.rundir.disk.guarded` waits it out) is cut back to the last whole line before the
    next try, so no torn line is ever followed by another. A compressed log is appended to only where a member
    ends: its one writer (the trainer) first truncates it to the size its checkpoint recorded.
    """

    def __init__(self, path: os.PathLike | str, fsync: bool = True):
        self.path = Path(path)
        make_dirs(self.path.parent)
        self._fsync = fsync
        self._compressed = is_compressed(self.path)
        self._fd = guarded("a log", self.path, 0,
                           lambda: os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        # A previous writer killed mid-line left a fragment: end it so our first
        # record starts on its own line (the fragment is then skipped as invalid).
        size = os.fstat(self._fd).st_size
        if size > 0 and not self._compressed:
            with open(self.path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    self._write(b"\n")

    def append(self, record: dict) -> None:
        """Append one record as a line, durably."""
        self.append_many([record])

    def append_many(self, records: list[dict]) -> None:
        """Append records as lines with one write and one fsync (one gzip member)."""
        if records:
            data = b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in records)
            self._write(gzip.compress(data, compresslevel=6, mtime=0) if self._compressed else data)

    def _write(self, data: bytes) -> None:
        start = os.fstat(self._fd).st_size

        def write() -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if self._fsync:
                os.fsync(self._fd)
        guarded("log lines", self.path, len(data), write,
                undo=lambda: os.ftruncate(self._fd, start))

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


def is_compressed(path: os.PathLike | str) -> bool:
    """Whether a log holds its lines gzip-compressed (its name ends in ``.gz``)."""
    return Path(path).suffix == ".gz"


DAMAGED = b"<damaged compressed data: the rest of the log cannot be read>"
"""Where the members of a compressed log stop making sense, its lines end with this torn one (readers report it)."""


def read_log_bytes(path: os.PathLike | str) -> bytes:
    """A log's lines as bytes: the file, or a ``*.gz`` log's members decompressed in order (a head released by
    :func:`~hpcrl.rundir.disk.release_head` skipped; a member cut short gives what it holds; damaged data ends the lines with
    :data:`DAMAGED`). FileNotFoundError if missing."""
    data = Path(path).read_bytes()
    if not is_compressed(path):
        return data
    data = data.lstrip(b"\0")  # the head disk.release_head gave back
    out: list[bytes] = []
    while data:
        member = zlib.decompressobj(wbits=31)
        try:
            out.append(member.decompress(data))
        except zlib.error:
            lines = b"".join(out)
            return lines + (b"" if lines.endswith(b"\n") or not lines else b"\n") + DAMAGED
        if not member.eof:
            break
        data = member.unused_data
    return b"".join(out)


def read_jsonl(path: os.PathLike | str, on_bad_line: Optional[Callable[[int, str], None]] = None) -> Iterator[dict]:
    """Yield the complete JSON lines of ``path`` (a ``*.gz`` log decompressed); a torn or invalid line is skipped
    (and reported through ``on_bad_line(lineno, text)``)."""
    try:
        lines = read_log_bytes(path).splitlines(keepends=True) if is_compressed(path) else open(path, "rb")
    except FileNotFoundError:
        return
    try:
        for lineno, raw in enumerate(lines, 1):
            if not raw.endswith(b"\n"):
                if on_bad_line:
                    on_bad_line(lineno, raw.decode(errors="replace"))
                return
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                if on_bad_line:
                    on_bad_line(lineno, raw.decode(errors="replace"))
    finally:
        if not isinstance(lines, list):
            lines.close()


class JsonlTail:
    """Complete lines appended to a JSONL file since the last call (tolerant of torn last lines); plain logs only."""

    def __init__(self, path: Path):
        if is_compressed(path):
            raise ValueError(f"{path}: a compressed log is read whole (read_jsonl), not followed")
        self.path = path
        self.offset = 0
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        """Every complete row so far (new ones parsed from where the last call stopped)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self.rows
        if size < self.offset:  # rolled back by a resumed trainer: start over
            self.offset, self.rows = 0, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1  # only complete lines; a torn tail waits for its newline
        for raw in data[:end].splitlines():
            try:
                self.rows.append(json.loads(raw))
            except ValueError:
                pass  # an invalid complete line (a writer killed mid-line, then restarted): skipped
        self.offset += end
        return self.rows


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float, log: Any,
             log_every_s: float = 10.0, describe: Optional[Callable[[], str]] = None,
             stop: Optional[Callable[[], None]] = None) -> Any:
    """Poll ``check()`` until it returns something truthy; log what we wait for;
    raise TimeoutError naming it after ``timeout_s``.

    ``stop()`` is called at every poll and may raise to end the wait early (the jobs
    pass :func:`hpcrl.process.termination.check`, so a SIGTERM whose own SystemExit
    was swallowed still ends the wait).
    """
    start = time.monotonic()
    last_log = start
    while True:
        if stop is not None:
            stop()
        result = check()
        if result:
            return result
        now = time.monotonic()
        if now - start > timeout_s:
            extra = f" ({describe()})" if describe else ""
            raise TimeoutError(f"gave up after {timeout_s:.0f}s waiting for {what}{extra}")
        if now - last_log >= log_every_s:
            extra = f" ({describe()})" if describe else ""
            log.info("waiting %.0fs so far for %s%s", now - start, what, extra)
            last_log = now
        time.sleep(poll_s)
