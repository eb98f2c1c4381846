"""A weight transport that copies each committed version into a folder of the node's temporary directory, which the
readers on the node load from: the smallest transport there is (its files are a second copy beside the store's;
nothing of the store's commit, retention, bad markers or pins is its business). A version is there once its
``vN.json`` (written last) is."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file, save_file

from hpcrl.weights.transport import Received, Sent, TransportReceiver, TransportSender

log = logging.getLogger(__name__)

NAME = "copy"
WAIT_S = 5.0
"""How long a reader waits for a version the store has committed to appear here."""


def folder_of(run_dir) -> Path:
    """The node-local folder of ``run_dir``'s copies."""
    digest = hashlib.sha256(str(run_dir.root.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"hpcrl-copy-transport-{digest}"


class CopySender(TransportSender):
    def __init__(self, run_dir):
        self.folder = folder_of(run_dir)

    @classmethod
    def from_config(cls, cfg, run_dir, timeouts) -> "CopySender":
        return cls(run_dir)

    def send(self, version, host_tensors, device_tensors, aliases, manifest) -> Sent:
        t0 = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = self.folder / f"v{version}.safetensors"
        save_file(host_tensors, str(tensors) + ".tmp")
        os.replace(str(tensors) + ".tmp", tensors)
        record = {"published_s": manifest.published_s, "aliases": aliases}
        (self.folder / f"v{version}.json.tmp").write_text(json.dumps(record))
        os.replace(self.folder / f"v{version}.json.tmp", self.folder / f"v{version}.json")
        for old in (self.folder / f"v{version - 3}.json", self.folder / f"v{version - 3}.safetensors"):
            old.unlink(missing_ok=True)
        return Sent(NAME, 0, time.monotonic() - t0, tensors.stat().st_size)


class CopyReceiver(TransportReceiver):
    def __init__(self, run_dir, reader: str):
        self.folder, self.reader = folder_of(run_dir), reader

    @classmethod
    def from_config(cls, cfg, run_dir, reader, timeouts, device) -> "CopyReceiver":
        return cls(run_dir, reader)

    def receive(self, version: int) -> Optional[Received]:
        record = self.folder / f"v{version}.json"
        end = time.monotonic() + WAIT_S
        while not record.exists():
            if time.monotonic() > end:
                return None
            time.sleep(0.05)
        t0 = time.monotonic()
        try:
            meta = json.loads(record.read_text())
            path = self.folder / f"v{version}.safetensors"
            state = load_file(str(path))
        except (OSError, ValueError) as e:  # removed meanwhile: the files have it
            log.warning("copy transport: version %d is gone (%s); reading the files", version, e)
            return None
        for alias, stored in meta["aliases"].items():
            state[alias] = state[stored]
        log.info("copy transport: %s received weight version %d", self.reader, version)
        return Received(state, meta["published_s"], NAME, time.monotonic() - t0, path.stat().st_size)
