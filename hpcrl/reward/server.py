"""The reward service: one TCP socket, one thread per client connection, one model.

A connection first passes the handshake (``wire.py``), then sends requests one at a time. A discriminative model's
items go to the :class:`Batcher`: one thread pools everything that is waiting (several rollout jobs' groups) and
scores it in forwards of similar lengths (the least padding), so requests from many clients share forwards and
each is answered as its last item is scored; a generative judge's requests are scored in
their connection's thread, all in flight at once (the engine batches them). Every request is answered with the same
``id``; an item the model cannot score has a None score and its reason; a request the server cannot read ends its
connection (named in the log). The server keeps what the job reports: items and requests served, the model's busy
seconds (so its idle share), the most items waiting at once.

What it waits for: nothing but its clients (a connection idle for a while is simply kept; the socket's accept
loop wakes every :data:`ACCEPT_POLL_S` to see whether the server is closing).
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from hpcrl.reward.models import RewardModel, Scored
from hpcrl.reward.wire import GENERATE, Reply, Request, WireError, recv_frame, send_frame, server_handshake

log = logging.getLogger("hpcrl.reward")

ACCEPT_POLL_S = 0.5
HANDSHAKE_S = 30.0
"""A connection must finish the handshake within this; then it may stay idle as long as its client likes."""


@dataclass
class ServerStats:
    """What the service did (the job's heartbeat and log rows read it; one lock guards it)."""

    started_s: float = field(default_factory=time.monotonic)
    items: int = 0
    requests: int = 0
    model_s: float = 0.0
    """Seconds the model was computing (the rest of the job's life it was idle)."""
    batches: int = 0
    queue_max: int = 0
    refused: int = 0
    """Connections whose handshake failed."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, items: int, requests: int, model_s: float, batches: int = 1) -> None:
        """Count work done."""
        with self.lock:
            self.items += items
            self.requests += requests
            self.model_s += model_s
            self.batches += batches

    def idle_share(self) -> float:
        """The share of the service's life the model was not computing."""
        alive = max(time.monotonic() - self.started_s, 1e-9)
        return max(0.0, 1.0 - self.model_s / alive)


class _Request:
    """A request in the batcher: its future, its items' results so far, how many are still to score."""

    def __init__(self, n: int, fut: Future):
        self.fut, self.out, self.left = fut, [Scored(None)] * n, n

    def done(self) -> None:
        """Answer it (its items in its own order)."""
        if not self.fut.done():
            self.fut.set_result(self.out)


class Batcher:
    """One thread that scores every waiting request's items with a batched (discriminative) model, one forward at a
    time: all the items waiting, sorted by length, are cut into the forwards of least padding (``model.plan``), and
    the next forward is the one holding the oldest item (none waits behind newer ones for ever); requests that arrive
    meanwhile join the plan before the next forward, and a request is answered as soon as its last item is scored,
    its scores in its own order whatever order its items were scored in."""

    def __init__(self, model: RewardModel, stats: ServerStats):
        self.model, self.stats = model, stats
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting to be scored."""
        return self._queue.qsize()

    def submit(self, items: list) -> Future:
        """A future of the items' :class:`Scored` list."""
        fut: Future = Future()
        self._queue.put((items, fut))
        return fut

    def _take(self, pool: list, block: bool) -> bool:
        """Move the waiting requests' items into ``pool`` ((request, item index, input ids), oldest first); items the
        model cannot take are answered at once. True once :meth:`close` was called."""
        closing = False
        while True:
            try:
                got = self._queue.get(block=block)
            except queue.Empty:
                return closing
            block = False
            if got is None:
                closing = True
                continue
            items, fut = got
            req, mine = _Request(len(items), fut), []
            try:
                for k, item in enumerate(items):
                    ids = self.model.prepare(item)
                    if isinstance(ids, Scored):
                        req.out[k], req.left = ids, req.left - 1
                    else:
                        mine.append((req, k, ids))
            except Exception as e:  # noqa: BLE001 - the client gets the error and retries or counts it
                log.exception("the reward model could not read a request's items")
                fut.set_exception(e)
                continue
            pool.extend(mine)
            if req.left == 0:  # nothing the model can take: answered now
                req.done()
                self.stats.add(0, 1, 0.0, batches=0)

    def _run(self) -> None:
        pool: list = []
        closing = False
        while True:
            closing = self._take(pool, block=not pool and not closing) or closing
            if not pool:
                if closing:
                    return
                continue
            with self.stats.lock:
                self.stats.queue_max = max(self.stats.queue_max, len(pool))
            batch = next(b for b in self.model.plan([len(ids) for _, _, ids in pool]) if 0 in b)
            t0 = time.monotonic()
            try:
                scores = self.model.forward([pool[k][2] for k in batch])
            except Exception as e:  # noqa: BLE001 - the clients get the error and retry or count it
                log.exception("the reward model failed on %d items", len(batch))
                failed = {pool[k][0] for k in batch}
                for req in failed:
                    if not req.fut.done():
                        req.fut.set_exception(e)
                pool[:] = [p for p in pool if p[0] not in failed]
                continue
            answered = 0
            for k, value in zip(batch, scores):
                req, index, _ = pool[k]
                req.out[index], req.left = Scored(value), req.left - 1
                if req.left == 0:
                    req.done()
                    answered += 1
            taken = set(batch)
            pool[:] = [p for k, p in enumerate(pool) if k not in taken]
            self.stats.add(len(batch), answered, time.monotonic() - t0)

    def close(self) -> None:
        """Stop after the work already queued."""
        self._queue.put(None)
        self._thread.join(timeout=30)


class RewardServer:
    """The service of one reward job (module docstring): listens at once; :meth:`close` ends it."""

    def __init__(self, model: RewardModel, secret: bytes, job: str, epoch: str, host: str = ""):
        self.model, self.secret, self.job, self.epoch = model, secret, job, epoch
        self.stats = ServerStats()
        self.batcher = Batcher(model, self.stats) if model.batched else None
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._closing = threading.Event()
        self._conns: set[socket.socket] = set()  # open client connections, ended at close
        self.sock = socket.create_server((host, 0), backlog=128)
        self.sock.settimeout(ACCEPT_POLL_S)
        self.port = self.sock.getsockname()[1]
        self._accept = threading.Thread(target=self._accept_loop, name="reward-accept", daemon=True)
        self._accept.start()

    @property
    def queued(self) -> int:
        """Items received and not yet answered."""
        return self._inflight

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr), name=f"reward-conn-{addr[1]}",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        with self._inflight_lock:
            self._conns.add(conn)
        try:
            self._converse(conn, peer)
        finally:
            with self._inflight_lock:
                self._conns.discard(conn)

    def _converse(self, conn: socket.socket, peer: str) -> None:
        """The handshake, then requests answered one at a time until the client leaves or the server closes."""
        with conn:
            try:
                conn.settimeout(HANDSHAKE_S)
                client = server_handshake(conn, self.secret, self.job, self.epoch)
                conn.settimeout(None)
            except (OSError, WireError) as e:
                with self.stats.lock:
                    self.stats.refused += 1
                log.warning("connection from %s refused: %s", peer, e)
                return
            log.debug("%s connected from %s", client, peer)
            while not self._closing.is_set():
                try:
                    d = recv_frame(conn)
                except (OSError, WireError) as e:
                    if not isinstance(e, WireError) or "ended 0 bytes" not in str(e):
                        log.info("connection of %s (%s) ended: %s", client, peer, e)
                    return
                try:
                    send_frame(conn, self._answer(d, client).to_json())
                except OSError as e:
                    log.info("could not answer %s (%s): %s", client, peer, e)
                    return

    def _answer(self, d: dict, client: str) -> Reply:
        try:
            req = Request.from_json(d, f"a request of {client}")
        except ValueError as e:
            return Reply(id=d.get("id", -1) if isinstance(d.get("id"), int) else -1, error=str(e))
        n = len(req.items) + len(req.prompts)
        with self._inflight_lock:
            self._inflight += n
        try:
            if req.op == GENERATE:
                t0 = time.monotonic()
                texts = self.model.generate(req.prompts, req.max_new_tokens, req.temperature == 0)
                self.stats.add(len(texts), 1, time.monotonic() - t0)
                return Reply(id=req.id, texts=texts, queued=self._inflight)
            t0 = time.monotonic()
            if self.batcher is not None:
                scored: list[Scored] = self.batcher.submit(req.items).result()
            else:
                scored = self.model.score(req.items)
                self.stats.add(len(scored), 1, time.monotonic() - t0)
            return Reply(id=req.id, scores=[s.score for s in scored], texts=[s.text for s in scored],
                         problems=[s.problem for s in scored], queued=self._inflight,
                         model_s=time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - said to the client, which counts it or retries
            log.warning("request %d of %s failed: %s: %s", req.id, client, type(e).__name__, e)
            return Reply(id=req.id, error=f"{type(e).__name__}: {e}")
        finally:
            with self._inflight_lock:
                self._inflight -= n

    def close(self) -> None:
        """Stop accepting and answering; the batcher finishes what it holds."""
        self._closing.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self._accept.join(timeout=5)
        with self._inflight_lock:
            conns = list(self._conns)
        for conn in conns:  # a connection thread waiting for its client's next request wakes and ends
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.batcher is not None:
            self.batcher.close()
