"""What crosses between a reward job and its clients (rollout jobs, the evaluation job), defined once.

**Where** (:class:`RewardService`, ``control/reward/<job>.json``): a reward job that has loaded its model listens on
an ephemeral TCP port and writes host, port and a fresh ``epoch`` (tmp -> fsync -> rename; its restart overwrites it
with a new port and epoch; its clean end removes it). Clients list the folder.

**Frames**: a 4-byte big-endian length, then a UTF-8 JSON object; nothing is ever unpickled, and a frame over
:data:`MAX_FRAME_BYTES` or one that is not a JSON object ends the connection with the reason (:class:`WireError`).

**Handshake** (the weight broadcast's, ``weights/rendezvous.py``: the run's ``secret`` never crosses the wire)::

    server  Hello{job, epoch, nonce_s}
    client  Proof{client, nonce_c, proof = HMAC(secret, client|epoch|nonce_s|nonce_c)}
    server  Welcome{ok, proof = HMAC(secret, server|epoch|nonce_c|nonce_s)} or Welcome{ok: false, reason}

A client refuses a server whose proof is wrong (a stranger on a reused port); a server refuses (and logs) a client
whose proof is wrong. Then the client sends :class:`Request` frames, one at a time per connection, and the server
answers each with a :class:`Reply` carrying the same ``id``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from hpcrl.rundir.json_record import JsonRecord, RecordError
from hpcrl.rundir.paths import RunDir

MAX_FRAME_BYTES = 256 << 20
"""The largest frame either side reads (a request of a few thousand long responses fits)."""
SCORE, GENERATE = "score", "generate"
"""The request kinds: score responses (:class:`ScoreItem`), or let a generative judge answer free prompts (a hybrid
reward function's own calls, ``RewardModelHandle.generate``)."""


class WireError(ConnectionError):
    """The peer broke the protocol (a bad frame, a failed handshake) or the connection ended mid-frame."""


class RewardUnavailable(Exception):
    """No reward job could score a response: the job stopped while waiting (:class:`RewardWaitStopped`) or none
    answered within ``reward_model.wait_s`` (:class:`RewardWaitTimeout`). Never a reward of 0: the group is not
    committed (a rollout job that stops saves or regenerates it; one past the deadline fails, naming the jobs)."""


class RewardWaitStopped(RewardUnavailable):
    """The job stopped while a request waited for a reward job (its group is abandoned like any group in flight)."""


class RewardWaitTimeout(RewardUnavailable, TimeoutError):
    """No reward job answered within ``reward_model.wait_s``."""


class Scored(NamedTuple):
    """One item's result: its score (None when it has none), the judge's text, and why there is no score."""

    score: Optional[float]
    text: str = ""
    problem: str = ""


@dataclass
class RewardService(JsonRecord):
    """``control/reward/<job>.json``: where one reward job serves. Written by that job once its model is loaded and
    its socket listens (tmp -> fsync -> rename), removed at its clean end; read by every client."""

    job: str
    """The reward job (``reward-0``)."""
    host: str
    port: int
    epoch: str
    """Random token of this process's service: a restarted job is a new epoch."""
    pid: int
    kind: str
    """``discriminative`` or ``generative``."""
    created_s: float

    @property
    def address(self) -> str:
        """``host:port`` for log lines."""
        return f"{self.host}:{self.port}"


@dataclass
class ScoreItem(JsonRecord):
    """One response to score, as a client sends it; the reward job builds the model's input from it
    (``reward/inputs.py``)."""

    prompt: Any
    """The row's prompt as the data has it: a string or a list of ``{role, content}`` chat messages."""
    prompt_ids: list[int]
    """The prompt as the policy saw it (chat template applied)."""
    response_ids: list[int]
    """The response's tokens (its EOS included when it has one; a tool's tokens too)."""
    response: str
    """The response decoded by the policy's tokenizer, special tokens skipped."""
    ground_truth: str = ""
    data_source: str = ""


@dataclass
class Request(JsonRecord):
    """A client's request: ``score`` the ``items``, or ``generate`` an answer to each of ``prompts``."""

    id: int
    op: str
    items: list[ScoreItem] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    """``generate``: a string or a list of chat messages each."""
    max_new_tokens: Optional[int] = None
    temperature: Optional[float] = None

    def check(self) -> None:
        """A known kind."""
        if self.op not in (SCORE, GENERATE):
            raise RecordError(f"request op {self.op!r}; allowed: {SCORE}, {GENERATE}")


@dataclass
class Reply(JsonRecord):
    """The server's answer to request ``id``: a score (or None with its reason) and the judge's text per item, or
    ``error`` for the whole request."""

    id: int
    scores: list[Optional[float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """A generative judge's verdicts (``score``) or answers (``generate``); empty for a discriminative model."""
    problems: list[str] = field(default_factory=list)
    """Per item: why its score is None ("" when it has one)."""
    error: str = ""
    queued: int = 0
    """Items waiting at the server when it answered: the clients' measure of its load."""
    model_s: float = 0.0
    """Seconds the model spent on this request's items."""


def send_frame(sock: socket.socket, obj: dict) -> None:
    """One frame: length, then the JSON of ``obj``."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WireError(f"the connection ended {n - left} bytes into a {n}-byte read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict:
    """The next frame's JSON object; WireError for a frame too large, not JSON, or not an object."""
    (n,) = struct.unpack(">I", _read_exact(sock, 4))
    if n > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {n} bytes (more than {MAX_FRAME_BYTES}): not a reward-service peer")
    try:
        obj = json.loads(_read_exact(sock, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"a frame that is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise WireError(f"a frame that is not a JSON object ({str(obj)[:60]})")
    return obj


def read_run_secret(run_dir: RunDir) -> bytes:
    """The run's secret (``RUN/secret``, written at launch); WireError naming the file if it is missing or empty."""
    try:
        secret = run_dir.secret.read_text().strip()
    except OSError as e:
        raise WireError(f"cannot read the run's secret {run_dir.secret}: {e}") from None
    if not secret:
        raise WireError(f"the run's secret {run_dir.secret} is empty")
    return secret.encode()


def _proof(secret: bytes, side: str, epoch: str, first: str, second: str) -> str:
    return hmac.new(secret, f"{side}|{epoch}|{first}|{second}".encode(), hashlib.sha256).hexdigest()


def server_handshake(sock: socket.socket, secret: bytes, job: str, epoch: str) -> str:
    """The server's side of the handshake; the client's name, or WireError (refused, said to the client)."""
    nonce_s = secrets.token_hex(16)
    send_frame(sock, {"job": job, "epoch": epoch, "nonce": nonce_s})
    hello = recv_frame(sock)
    client, nonce_c, proof = str(hello.get("client", "?")), str(hello.get("nonce", "")), str(hello.get("proof", ""))
    if not hmac.compare_digest(proof, _proof(secret, "client", epoch, nonce_s, nonce_c)):
        send_frame(sock, {"ok": False, "reason": "wrong proof: not a job of this run (another secret)"})
        raise WireError(f"refused client {client!r}: its proof does not match this run's secret")
    send_frame(sock, {"ok": True, "proof": _proof(secret, "server", epoch, nonce_c, nonce_s)})
    return client


def client_handshake(sock: socket.socket, secret: bytes, client: str, service: RewardService) -> None:
    """The client's side: prove the secret, check the server's proof and that it is ``service``'s epoch;
    WireError naming what failed."""
    hello = recv_frame(sock)
    if hello.get("epoch") != service.epoch or hello.get("job") != service.job:
        raise WireError(f"{service.address} is not {service.job} of epoch {service.epoch} (it says "
                        f"{hello.get('job')!r}, epoch {hello.get('epoch')!r}): a stale record")
    nonce_c = secrets.token_hex(16)
    send_frame(sock, {"client": client, "nonce": nonce_c,
                      "proof": _proof(secret, "client", service.epoch, str(hello.get("nonce", "")), nonce_c)})
    welcome = recv_frame(sock)
    if not welcome.get("ok"):
        raise WireError(f"{service.job} at {service.address} refused this job: {welcome.get('reason', '?')}")
    want = _proof(secret, "server", service.epoch, nonce_c, str(hello.get("nonce", "")))
    if not hmac.compare_digest(str(welcome.get("proof", "")), want):
        raise WireError(f"{service.address} does not know this run's secret: not {service.job}")
