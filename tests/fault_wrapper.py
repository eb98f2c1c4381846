"""Run ``python -m hpcrl ARGS`` with a fault injected from outside the product code.

Used by tests that must reproduce a bug on old commits too (which have no
``HPCRL_FAULT_POINT`` hook). ``TEST_TERM_AFTER_MANIFEST_APPEND=N``: right after
the N-th line appended to a shard ``manifest.jsonl`` returns (written and
fsync'd: durable), the process sends itself SIGTERM; the handler runs at once,
inside ``ShardWriter.seal()`` between "durable" and "recorded in memory".
``TEST_SLOW_MANIFEST_FSYNC_S=S`` sleeps S seconds in each manifest append (an
NFS/Lustre fsync) before it.
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpcrl.rundir import fsio  # noqa: E402

_term_after = int(os.environ.get("TEST_TERM_AFTER_MANIFEST_APPEND", "0"))
_slow_s = float(os.environ.get("TEST_SLOW_MANIFEST_FSYNC_S", "0"))
_appends = 0
_real_append_many = fsio.JsonlAppender.append_many


def _append_many(self, records):
    global _appends
    if self.path.name != "manifest.jsonl":
        return _real_append_many(self, records)
    if _slow_s:
        time.sleep(_slow_s)
    _real_append_many(self, records)
    _appends += 1
    if _appends == _term_after:
        os.kill(os.getpid(), signal.SIGTERM)


fsio.JsonlAppender.append_many = _append_many

if __name__ == "__main__":
    from hpcrl.cli import main

    sys.exit(main(sys.argv[1:]))
