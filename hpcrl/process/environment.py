"""A process's environment as it was before a block that changes it: importing vLLM sets ``LD_LIBRARY_PATH``
(with an empty entry: the working directory), ``TORCHINDUCTOR_COMPILE_THREADS`` and others in ``os.environ``; a
launcher that imported it for a check passed them on to every job it submitted."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def environment_restored() -> Iterator[None]:
    """``os.environ`` as it was, once the block ends (the modules it imported stay imported)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
