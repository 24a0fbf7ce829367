"""torch.distributed transport: every sender/receiver pair gets its own 2-rank process group.

There is no global world and the default group is never touched (an engine's TP group may own it
in the same process). Each ``serve`` starts a TCPStore; a sender's channel pairs up through it on
first use, and replicas come and go without anyone knowing the set in advance.

    sender channel (rank 1)                            receiver endpoint (rank 0)
    id = 128 random bits; set(pair/id/hello);       ──▶ accept thread pops ids: verdict (ok | refused:
      queue_push(pairs/queue, id)                       full, or the header is not authentic)
      (hello: where its KV is, and the signed header
       of the chunk it pairs to send)
    ProcessGroupGloo(PrefixStore("pair/id"), 1, 2) ◀─▶ pair thread: ProcessGroupGloo(..., 0, 2)
    per chunk:  head [sizes, deadline | header]    ──▶ sizes checked before allocating
                                                   ◀── go | refused        (layer chunks only)
                payload                            ──▶ apply()             (layer chunks only)
                                                   ◀── verdict [status, reason]
    in place:   head [..., n pieces | header]      ──▶ begin_direct(): checked, targets reserved
                piece 1 .. piece n  (posted at once)   ──▶ straight into the reserved blocks
                                                   ◀── verdict                 (end_direct())

A chunk sent in place travels from the sender's cache into the receiver's blocks with no copy on
either side, a piece per run of consecutive blocks (K runs, then V runs): measured here, a copy of
a 32 MB layer on each side halves what the pair carries (1.4-1.9 against 3-4 GB/s). It needs no
"go": gloo moves a message only once its receive is posted, so pieces wait at the sender until the
receiver has checked the header and posted receives into the reserved blocks. A receiver that
refuses (or declines) such a chunk answers without posting them and both ends drop the pair, whose
pending pieces die with it; the sender pairs afresh for its next chunk.

Messages alternate direction on purpose: measured on loopback, each extra back-to-back send on
one gloo pair costs ~1-2 ms, a ping-pong ~0.1 ms, unless the receiver has posted its receives
first (the pieces of a chunk: no extra cost measured). Head and verdict have fixed sizes,
so each is a single message.

Trust: gloo trusts its peer. A message larger than the receive posted for it aborts the whole
process inside gloo (an enforce, not an exception). So pairing is authenticated: the hello carries
the header of the chunk the sender pairs to send, signed with its ticket's secret, and a pair is
made only for a sender that holds a live ticket here. The store itself (torch's TCPStore) takes
writes from anyone who reaches it, so pairing depends on nothing a stranger can push out of the
way: each sender announces a random id of its own on a queue, and the accept thread pops ids and
answers those with a hello, skipping any other at the cost of a store round trip (7f34ac8 paired by
a shared counter, which ``add("pairs/next", 10**6)`` pushed past every waiting sender: each push
stalled pairing for a deadline, and pushes every half second stopped it). Every chunk is still
authenticated before any receive into the cache is posted, and a sender sends in place only pieces
of the receiver's block size. A stranger who can reach the store can still delete or pop what
senders write there: serve this backend on loopback or a trusted network; gRPC checks every byte
it is sent.

Host payloads travel over gloo; a CUDA payload for a CUDA receiver travels over NCCL, in a second
group of the same pair, made at pairing when both ends hold GPU caches (the sender's hello says
where its KV is; at most ``max_nccl_pairs`` per endpoint) and kept for the pair's life
(``nccl_pair_idle_s``). Its failures stay the pair's (``_kv_nccl_group``); its operations run on
the threads' transfer streams (``kv_transfer.device_streams``), never the compute stream. That
path needs two GPUs: ``bench.gpu_check`` runs it where there are two; CI has none.
Every wait carries the chunk's deadline. Gloo closes a pair whose wait timed out, so any error
drops the pair on both sides and the sender pairs afresh on its next chunk. A pair thread waits at
most ``pair_idle_s`` for the next chunk (gloo cannot interrupt a pending recv any other way); the
sender re-pairs once its pair has idled half that long, so it never sends into a closing pair.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import logging
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import torch
import torch.distributed as dist

from common.errors import ConfigError
from common.nccl_env import ASYNC_ERROR_HANDLING, group_construction
from common.openmp import run_tensor_ops_serially
from kv_transfer.device_streams import current_transfer_device
from kv_transfer.protocol import MAX_DIRECT_PIECES
from kv_transfer.receiver import KVReceiver, NotInPlace
from kv_transfer.transport import KVChannel, KVTransport, TransferRefused

logger = logging.getLogger(__name__)

_QUEUE = "pairs/queue"  # senders' pair ids, in the order they announced them
_PAIR_ID = re.compile(r"[0-9a-f]{32}")
_RECENT_IDS = 4096  # ids admitted lately: one pushed again (by anyone) is not admitted twice
_HEAD = struct.Struct("<5q")  # header_len, payload_len, timeout_ms, payload_on_device, pieces; then the header
_HEAD_BYTES = 2048
_MAX_HEADER = _HEAD_BYTES - _HEAD.size
_VERDICT = struct.Struct("<2q")  # status, reason_len; then the reason
_VERDICT_BYTES = 512
_OK, _REFUSED, _UNAVAILABLE, _DECLINED = 0, 1, 2, 3  # verdict status; _OK before a payload means "go"
_TAG = 0  # one tag: messages of a pair are matched in order
_ACCEPT_POLL_S = 0.01  # adds to pairing latency; polls with check(), as a timed-out wait() logs warnings


@dataclass(frozen=True)
class TorchDistConfig:
    max_pairs: int = 64  # concurrent senders per served endpoint; more are refused at pairing
    max_payload_bytes: int = 1 << 30  # a larger chunk is refused before anything is allocated
    connect_timeout_s: float = 10.0  # pairing: store connect, verdict and rendezvous
    pair_idle_s: float = 60.0  # a pair without a chunk for this long is closed
    # A payload received in place must keep coming: its receive ends after payload_stall_s plus its
    # bytes at payload_min_bytes_per_s. That bounds how long a stalled sender holds blocks that
    # release() must wait for (gloo's receive cannot be cut short from another thread).
    payload_stall_s: float = 1.0
    payload_min_bytes_per_s: float = 64e6
    # A pair's NCCL group's own timeout, at least a KV lease: each wait still ends at its chunk's
    # deadline (then the pair is aborted); past this the watchdog would report the group broken.
    nccl_timeout_s: float = 600.0
    # Pairs whose two ends hold GPU caches get an NCCL communicator at pairing, kept for the pair's
    # life; at most this many per endpoint (each holds GPU memory outside the KV budget: a pair
    # beyond them carries GPU KV through the host), idling up to nccl_pair_idle_s before closing.
    max_nccl_pairs: int = 8
    nccl_pair_idle_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("max_pairs", "max_payload_bytes", "max_nccl_pairs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"torch KV transport: {name}={getattr(self, name)} must be at least 1")
        for name in (
            "connect_timeout_s",
            "pair_idle_s",
            "nccl_pair_idle_s",
            "payload_stall_s",
            "payload_min_bytes_per_s",
            "nccl_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"torch KV transport: {name}={getattr(self, name)} must be a positive number")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _io(post: Callable[[], dist.Work], deadline: float, what: str) -> None:
    """Post one send/recv and wait for it until ``deadline``; gloo/store errors become Timeout/ConnectionError."""
    try:
        post().wait(_td(deadline - time.monotonic()))
        return
    except RuntimeError as exc:  # DistError and gloo's errors; the Work dies here, not in a traceback
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "timed out" in message.lower() or "timeout" in message.lower():
        raise TimeoutError(f"{what}: timed out ({message})")
    raise ConnectionError(f"{what}: {message}")


_devices: dict[str, object] = {}
_devices_lock = threading.Lock()


_NCCL_AT_PAIRING, _NCCL_LAZY, _NO_NCCL = "at pairing", "lazy", "none"  # a receiving pair's NCCL


_coalescing_returns_work = True  # until a torch shows otherwise: then pieces go one send each


def _no_coalescing_work(group, device: torch.device) -> None:
    """A torch whose coalescing hands back no handle: nothing to wait on but the device itself
    (NCCL's stream is not this thread's), this once; later chunks post their pieces one by one."""
    global _coalescing_returns_work
    _coalescing_returns_work = False
    logger.warning("this torch's NCCL coalescing returns no handle: KV pieces go one send each")
    torch.cuda.synchronize(device)


def _gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (the same GPU whatever CUDA_VISIBLE_DEVICES calls it), if torch reports it."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return None


def _kv_nccl_group(store: dist.Store, rank: int, timeout_s: float):
    """A pair's NCCL group whose failures stay the pair's. Its operations' timeout is at least a
    KV lease (each wait carries the chunk's own, shorter deadline: a timed-out wait raises here and
    the pair is aborted). torch's watchdog tears the whole process down when an operation of a group
    made under its default error handling outlives the group's timeout (an engine replica, for one
    slow chunk); this group is made with that handling off (read when a group is made: every NCCL
    group of the process is made under ``common.nccl_env``'s lock, so none inherits this value), so
    a failed or timed-out transfer fails its hand-off, never the process. The engine's own TP
    groups keep the default."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _td(timeout_s)
    with group_construction(**{ASYNC_ERROR_HANDLING: "0"}):
        return dist.ProcessGroupNCCL(store, rank, 2, options)


def _gloo_device(host: str):
    """One gloo TCP device (one listener, one event loop) per local address, shared by every pair."""
    with _devices_lock:
        if host not in _devices:
            _devices[host] = dist.ProcessGroupGloo.create_device(hostname=host)
        return _devices[host]


class _Pair:
    """One end of a pair's groups: receiver rank 0, sender rank 1. Gloo always; NCCL for CUDA payloads."""

    def __init__(
        self, store: dist.Store, pair_id: str, rank: int, local_host: str, timeout_s: float, nccl_timeout_s: float
    ) -> None:
        self.store = store
        self.pair_id = pair_id
        self.rank = rank
        self.peer = 1 - rank
        self.timeout_s = timeout_s
        self.nccl_timeout_s = max(timeout_s, nccl_timeout_s)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _td(timeout_s)
        options._devices = [_gloo_device(local_host)]
        options._threads = 1  # send/recv never use gloo's collective worker threads
        self._gloo: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            dist.PrefixStore(f"pair/{pair_id}", store), rank, 2, options
        )
        self._nccl = None

    def _group(self, t: torch.Tensor):
        if t.device.type != "cuda":
            assert self._gloo is not None, "pair used after close"
            return self._gloo
        if self._nccl is None:  # both sides get here on the first CUDA payload; NCCL connects lazily
            self._nccl = _kv_nccl_group(
                dist.PrefixStore(f"pair/{self.pair_id}/nccl", self.store), self.rank, self.nccl_timeout_s
            )
        return self._nccl

    def connect_nccl(self, device: torch.device, deadline: float) -> None:
        """Make the pair's NCCL communicator now, at pairing, both ends together (one element
        sent from the sender to the receiver): made inside the first chunk's send instead, a
        receiver that refused that chunk never joined, and the sender hung until the store's timeout."""
        probe = torch.zeros(1, dtype=torch.uint8, device=device)
        # NCCL's set-up waits for the peer with no deadline of its own: past ours the pair is closed
        # (the group aborted) so this thread is not held by a peer that went away meanwhile.
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), self.close)
        watchdog.daemon = True
        watchdog.start()
        try:
            if self.rank == 1:
                self.send(probe, deadline, "connecting the pair's NCCL communicator")
            else:
                self.recv(probe, deadline, "connecting the pair's NCCL communicator")
        finally:
            watchdog.cancel()

    def send(self, t: torch.Tensor, deadline: float, what: str) -> None:
        group = self._group(t)
        _io(lambda: group.send([t], self.peer, _TAG), deadline, what)

    def recv(self, t: torch.Tensor, deadline: float, what: str) -> None:
        group = self._group(t)
        _io(lambda: group.recv([t], self.peer, _TAG), deadline, what)

    def send_all(self, parts: list[torch.Tensor], deadline: float, what: str) -> None:
        self.wait_all(self.post_all("send", parts), deadline, what)

    def recv_all(self, parts: list[torch.Tensor], deadline: float, what: str) -> None:
        self.wait_all(self.post_all("recv", parts), deadline, what)

    def post_all(self, op: str, parts: list[torch.Tensor]) -> list[dist.Work]:
        """Post every piece at once (messages of a pair keep their order). GPU pieces go as one NCCL
        group (one launch for the chunk's runs of blocks, not one per run), each side grouping its
        own, where this torch's coalescing hands back the group's handle to wait on."""
        if len(parts) > 1 and all(t.device.type == "cuda" for t in parts):
            group = self._group(parts[0])
            if getattr(group, "supports_coalescing", False) and _coalescing_returns_work:
                group._start_coalescing(parts[0].device)
                try:
                    for t in parts:
                        getattr(group, op)([t], self.peer, _TAG)
                finally:
                    work = group._end_coalescing(parts[0].device)
                if work is not None:
                    return [work]
                _no_coalescing_work(group, parts[0].device)  # this once: the device's whole queue
        return [getattr(self._group(t), op)([t], self.peer, _TAG) for t in parts]

    @staticmethod
    def wait_all(works: list[dist.Work], deadline: float, what: str) -> None:
        try:
            for work in works:
                _io(lambda work=work: work, deadline, what)
        finally:
            works.clear()  # a failed pair's pending work dies with it, not in a traceback

    def close(self) -> None:
        """Destroys the groups; the peer's pending and later operations fail with 'connection closed'."""
        if self._nccl is not None:
            with contextlib.suppress(Exception):
                self._nccl.abort()
        self._gloo = self._nccl = None


def _send_verdict(pair: _Pair, buf: torch.Tensor, status: int, reason: str, deadline: float) -> None:
    data = reason.encode()[: _VERDICT_BYTES - _VERDICT.size]
    view = memoryview(buf.numpy())
    _VERDICT.pack_into(view, 0, status, len(data))
    view[_VERDICT.size : _VERDICT.size + len(data)] = data
    pair.send(buf, deadline, "sending a verdict")


def _recv_verdict(pair: _Pair, buf: torch.Tensor, deadline: float) -> tuple[int, str]:
    pair.recv(buf, deadline, "waiting for the receiver's verdict")
    view = memoryview(buf.numpy())
    status, reason_len = _VERDICT.unpack_from(view)
    if not 0 <= reason_len <= _VERDICT_BYTES - _VERDICT.size:
        raise ConnectionError(f"malformed verdict (reason of {reason_len} bytes)")
    return status, bytes(view[_VERDICT.size : _VERDICT.size + reason_len]).decode(errors="replace")


# --- receiver side ---------------------------------------------------------------------------

_live_endpoints: set[_Endpoint] = set()  # until shut down, even if their transport is dropped
_live_lock = threading.Lock()


class _Endpoint:
    """One served receiver: a store that only ``host`` can reach, an accept thread and its pair threads."""

    def __init__(self, receiver: KVReceiver, host: str, config: TorchDistConfig) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"serve on the address senders should use, not the wildcard {host!r}")
        self.receiver = receiver
        self.config = config
        self.host = host
        self.device = receiver.kv_caches[0].device
        # TCPStore binds every interface whatever host it is given: bind the listener ourselves.
        listener = socket.create_server(
            (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
        )
        self.port = listener.getsockname()[1]
        self.store: dist.TCPStore | None = dist.TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=_td(config.connect_timeout_s),
            master_listen_fd=listener.detach(),  # the store owns the socket from here on
        )
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._pairs: dict[str, threading.Thread] = {}
        self._nccl_pairs: set[str] = set()  # pairs with an NCCL communicator
        self.num_ids_skipped = 0  # ids popped with no hello behind them (junk, or pushed twice)
        self._accept = threading.Thread(target=self._accept_loop, name=f"kv-torch-accept-{self.port}", daemon=True)
        self._accept.start()
        with _live_lock:
            _live_endpoints.add(self)

    @property
    def num_pairs(self) -> int:
        with self._lock:
            return len(self._pairs)

    def _accept_loop(self) -> None:
        store = self.store
        assert store is not None
        recent: collections.deque[str] = collections.deque(maxlen=_RECENT_IDS)
        try:
            while not self.stopped.is_set():
                try:
                    raw = store.queue_pop(_QUEUE, False)
                except dist.QueueEmptyError:
                    self.stopped.wait(_ACCEPT_POLL_S)
                    continue
                pair_id = raw.decode("ascii", errors="replace") if isinstance(raw, bytes) else str(raw)
                # Anything but a hello's id (a stranger's push) costs one round trip, and no wait.
                if _PAIR_ID.fullmatch(pair_id) and pair_id not in recent and store.check([f"pair/{pair_id}/hello"]):
                    recent.append(pair_id)
                    self._admit(store, pair_id)
                else:
                    self.num_ids_skipped += 1
        except Exception:
            if not self.stopped.is_set():
                logger.exception("torch KV transport on port %d stopped accepting", self.port)

    def _admit(self, store: dist.TCPStore, pair_id: str) -> None:
        cfg = self.config
        thread = None
        try:  # where the sender holds its KV, and the signed header of its first chunk
            hello = msgpack.unpackb(store.get(f"pair/{pair_id}/hello") or msgpack.packb({}))
        except Exception:
            hello = {}
        hello = hello if isinstance(hello, dict) else {}
        refused = self._unauthentic(hello.get("header"))
        if refused is not None:
            logger.warning("torch KV transport on port %d refused pair %s: %s", self.port, pair_id, refused)
            store.set(f"pair/{pair_id}/verdict", msgpack.packb({"ok": False, "refused": True, "reason": refused}))
            return
        legacy = "device" not in hello  # its GPU payloads make the NCCL group lazily, on first use
        on_gpus = self.device.type == "cuda" and hello.get("device") == "cuda"
        # Both ends on one GPU: NCCL refuses a pair there; their KV goes through the host (gloo).
        one_gpu = on_gpus and hello.get("gpu") is not None and hello.get("gpu") == _gpu_uuid(self.device)
        with self._lock:
            nccl = on_gpus and not one_gpu and len(self._nccl_pairs) < cfg.max_nccl_pairs
            if len(self._pairs) < cfg.max_pairs:
                idle_s = cfg.nccl_pair_idle_s if nccl else cfg.pair_idle_s
                mode = _NCCL_LAZY if legacy and self.device.type == "cuda" else (_NCCL_AT_PAIRING if nccl else _NO_NCCL)
                thread = threading.Thread(
                    target=self._pair_loop, args=(pair_id, mode, idle_s), name=f"kv-torch-pair-{pair_id}", daemon=True
                )
                self._pairs[pair_id] = thread
                if nccl:
                    self._nccl_pairs.add(pair_id)
        if thread is None:
            logger.warning(
                "torch KV transport on port %d refused pair %s: %d pairs open", self.port, pair_id, cfg.max_pairs
            )
            verdict = {"ok": False, "reason": f"receiver at its limit of {cfg.max_pairs} concurrent pairs"}
        else:
            # device: where this side's cache is; nccl (absent for a sender from before it): whether
            # the pair's NCCL communicator is made now, at pairing (else GPU payloads go through the host).
            verdict = {"ok": True, "pair_idle_s": idle_s, "device": self.device.type}
            if not legacy:
                verdict["nccl"] = nccl
        store.set(f"pair/{pair_id}/verdict", msgpack.packb(verdict))
        if thread is not None:
            thread.start()

    def _unauthentic(self, header: object) -> str | None:
        """Why a hello's header proves no ticket here (None: it does; refusals for other reasons,
        a released or expired ticket, still prove the sender holds its secret)."""
        if not isinstance(header, bytes) or not 0 < len(header) <= _MAX_HEADER:
            return "pairing needs the signed header of the chunk to send"
        try:
            self.receiver.check_header(header, 0)
        except TransferRefused as exc:
            if exc.kind in ("malformed", "unknown_ticket", "bad_signature"):
                return str(exc)
        except Exception as exc:
            return f"unreadable header: {type(exc).__name__}"
        return None

    def _pair_loop(self, pair_id: str, mode: str, idle_s: float) -> None:
        run_tensor_ops_serially()  # lands KV: the engine thread owns the process's OpenMP team
        pair = None
        try:
            # The group keeps its own client of the store, so shutdown can close the listener under it.
            client = dist.TCPStore(self.host, self.port, is_master=False, timeout=_td(self.config.connect_timeout_s))
            pair = _Pair(client, pair_id, 0, self.host, self.config.connect_timeout_s, self.config.nccl_timeout_s)
            # NCCL receives and the landings after them on this thread's own stream, never the compute one.
            with self.receiver.landing_stream():
                if mode == _NCCL_AT_PAIRING:
                    pair.connect_nccl(self.device, time.monotonic() + self.config.connect_timeout_s)
                self._serve_pair(pair, mode != _NO_NCCL, idle_s)
        except (TimeoutError, ConnectionError, RuntimeError) as exc:  # the sender left, died or broke the protocol
            logger.debug("torch KV pair %s on port %d closed: %s", pair_id, self.port, exc)
        except Exception:
            logger.exception("torch KV pair %s on port %d failed", pair_id, self.port)
        finally:
            if pair is not None:
                pair.close()
            with self._lock:
                self._pairs.pop(pair_id, None)
                self._nccl_pairs.discard(pair_id)

    def _serve_pair(self, pair: _Pair, nccl: bool, idle_s: float) -> None:
        cfg = self.config
        head = torch.zeros(_HEAD_BYTES, dtype=torch.uint8)
        head_view = memoryview(head.numpy())
        verdict = torch.zeros(_VERDICT_BYTES, dtype=torch.uint8)
        buffer = torch.empty(0, dtype=torch.uint8)  # reused: apply() has copied the payload out when it returns
        first = True
        while True:
            pair.recv(head, time.monotonic() + idle_s, "waiting for the next chunk")
            if first:  # both ends finished the rendezvous: its keys are garbage now
                first = False
                for key in ("0/0", "0/1"):
                    with contextlib.suppress(Exception):
                        pair.store.delete_key(f"pair/{pair.pair_id}/{key}")
            header_len, payload_len, timeout_ms, on_device, pieces = _HEAD.unpack_from(head_view)
            deadline = time.monotonic() + min(max(timeout_ms, 1) / 1000, idle_s)
            if self.stopped.is_set():
                _send_verdict(pair, verdict, _UNAVAILABLE, "receiver shut down", deadline)
                return
            device = bool(on_device)  # the payload comes over NCCL, into this GPU
            if (
                not 0 < header_len <= _MAX_HEADER
                or payload_len < 0
                or (device and not nccl)
                or not 0 <= pieces <= MAX_DIRECT_PIECES
            ):
                raise ConnectionError(
                    f"malformed chunk head ({header_len}-byte header, {payload_len}-byte payload, "
                    f"on device: {bool(on_device)}, {pieces} pieces)"
                )
            header = bytes(head_view[_HEAD.size : _HEAD.size + header_len])
            if pieces and device != (self.device.type == "cuda"):
                # Pieces land where they are received: host pieces cannot go into GPU blocks (nor GPU
                # pieces into host ones). Declined: the sender sends copies (nothing was posted).
                _send_verdict(pair, verdict, _DECLINED, "pieces on another device than this cache", deadline)
                return
            if pieces:
                status, reason, posted = self._receive_in_place(pair, header, payload_len, pieces, deadline)
                _send_verdict(pair, verdict, status, reason, deadline)
                if not posted:
                    return  # the sender's pieces wait on receives that never come: drop the pair
                continue
            payload: memoryview | bytes | torch.Tensor = b""
            if payload_len:
                if payload_len > cfg.max_payload_bytes:
                    _send_verdict(
                        pair,
                        verdict,
                        _REFUSED,
                        f"payload of {payload_len} bytes exceeds this receiver's limit of {cfg.max_payload_bytes}",
                        deadline,
                    )
                    continue
                status, reason = self._check(header, payload_len)
                if status != _OK:  # before anything is allocated for it; the sender holds its payload back
                    _send_verdict(pair, verdict, status, reason, deadline)
                    continue
                _send_verdict(pair, verdict, _OK, "", deadline)
                if device:
                    target = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
                else:
                    if buffer.numel() < payload_len:
                        buffer = torch.empty(payload_len, dtype=torch.uint8)
                    target = buffer[:payload_len]
                pair.recv(target, deadline, "receiving a chunk payload")
                # A GPU payload lands from the GPU (apply takes it there); a host one without a copy.
                payload = target if device else memoryview(target.numpy())
            status, reason = self._apply(header, payload)
            _send_verdict(pair, verdict, status, reason, deadline)

    def _receive_in_place(
        self, pair: _Pair, header: bytes, nbytes: int, pieces: int, deadline: float
    ) -> tuple[int, str, bool]:
        """A chunk whose pieces go straight into the reserved blocks: (verdict status, reason,
        whether its pieces were received — if not, they are still pending at the sender)."""
        try:
            write = self.receiver.begin_direct(header, nbytes, pieces)
        except NotInPlace as exc:
            return _DECLINED, str(exc), False
        except TransferRefused as exc:
            return _REFUSED, str(exc), False
        except Exception as exc:
            logger.exception("checking a KV chunk failed")
            return _UNAVAILABLE, f"receiver error: {type(exc).__name__}: {exc}", False
        now = time.monotonic()
        cfg = self.config
        deadline = min(
            deadline, now + write.lease_left_s, now + cfg.payload_stall_s + nbytes / cfg.payload_min_bytes_per_s
        )
        try:
            pair.recv_all(write.targets, deadline, "receiving a chunk payload")
        except BaseException as exc:
            # Closed first: a closed pair writes nothing more into the targets, which release()
            # hands back to the engine as soon as end_direct() returns.
            pair.close()
            with contextlib.suppress(TransferRefused):
                self.receiver.end_direct(write, received=False, reason=str(exc))
            raise
        return *self._verdict_of(lambda: self.receiver.end_direct(write, received=True)), True

    def _check(self, header: bytes, payload_len: int) -> tuple[int, str]:
        return self._verdict_of(lambda: self.receiver.check_header(header, payload_len))

    def _apply(self, header: bytes, payload: memoryview | bytes | torch.Tensor) -> tuple[int, str]:
        return self._verdict_of(lambda: self.receiver.apply(header, payload))

    @staticmethod
    def _verdict_of(land: Callable[[], None]) -> tuple[int, str]:
        try:
            land()
            return _OK, ""
        except TransferRefused as exc:
            return _REFUSED, str(exc)
        except Exception as exc:
            logger.exception("applying a KV chunk failed")
            return _UNAVAILABLE, f"receiver error: {type(exc).__name__}: {exc}"

    def shutdown(self, join_s: float) -> None:
        with _live_lock:
            _live_endpoints.discard(self)
        self.stopped.set()
        self._accept.join(timeout=join_s)
        self.store = None  # closes the listener: new senders are refused at once
        end = time.monotonic() + join_s
        with self._lock:
            threads = list(self._pairs.values())
        for thread in threads:  # a pair idling in recv exits on its next chunk, its sender's close, or pair_idle_s
            thread.join(timeout=max(0.0, end - time.monotonic()))


# --- sender side -----------------------------------------------------------------------------


class _TorchDistChannel(KVChannel):
    def __init__(self, endpoint: str, config: TorchDistConfig) -> None:
        if not endpoint.startswith("torch://"):
            raise ValueError(f"not a torch KV endpoint: {endpoint!r} (expected torch://host:port)")
        host, _, port = endpoint.removeprefix("torch://").rpartition(":")
        self.endpoint = endpoint
        self.host = host.strip("[]")
        self.port = int(port)
        self.config = config
        self._lock = threading.Lock()
        self._pair: _Pair | None = None
        self._stuck_handshake: threading.Thread | None = None  # a pairing a silent receiver never answered
        self._pair_idle_s = config.pair_idle_s  # the receiver's, once paired
        self._receiver_device = "cpu"
        self._nccl = False  # this pair carries GPU payloads over NCCL
        self._last_used = 0.0
        self._head = torch.zeros(_HEAD_BYTES, dtype=torch.uint8)
        self._verdict = torch.zeros(_VERDICT_BYTES, dtype=torch.uint8)
        self.sends_in_place = True  # until the receiver declines it once
        self.sends_device_pieces = True  # GPU pieces travel over NCCL

    def send(
        self, header: bytes, payload: memoryview | bytes | torch.Tensor, timeout_s: float, tag: str | None = None
    ) -> None:
        with self._lock:
            deadline = self._ready(header, timeout_s)
            self._deliver(header, [self._payload_tensor(payload, "cuda" if self._nccl else "cpu")], False, deadline)

    def send_pieces(self, header: bytes, pieces: list[torch.Tensor], timeout_s: float, tag: str | None = None) -> bool:
        if not self.sends_in_place or not 0 < len(pieces) <= MAX_DIRECT_PIECES:
            return False
        with self._lock:
            deadline = self._ready(header, timeout_s)
            # Both ends on the host (gloo) or both on GPUs with NCCL; anything else is copied across.
            on_host = {piece.device.type for piece in pieces} == {"cpu"} and self._receiver_device == "cpu"
            on_gpus = {piece.device.type for piece in pieces} == {"cuda"} and self._nccl
            if not (on_host or on_gpus):
                return False
            parts = [piece.reshape(-1).view(torch.uint8) for piece in pieces]  # views: contiguous pieces
            return self._deliver(header, parts, True, deadline)

    def _ready(self, header: bytes, timeout_s: float) -> float:
        """Checks the header and pairs up (anew after idling); returns the chunk's deadline. Lock
        held. A pair made on a sending thread inside a GPU's transfer stream (where the KV lives)
        asks for NCCL."""
        deadline = time.monotonic() + timeout_s
        if len(header) > _MAX_HEADER:
            raise TransferRefused(
                f"chunk header of {len(header)} bytes exceeds the {_MAX_HEADER} this transport carries"
            )
        if self._pair is not None and time.monotonic() - self._last_used > self._pair_idle_s / 2:
            self._drop()  # the receiver closes idle pairs; re-pair rather than race it
        if self._pair is None:
            self._pair_up(deadline, current_transfer_device(), header)
        return deadline

    def _deliver(self, header: bytes, parts: list[torch.Tensor], in_place: bool, deadline: float) -> bool:
        """One chunk over the pair; False if the receiver declined taking it in place. Lock held."""
        pair = self._pair
        assert pair is not None
        try:
            status, reason = self._exchange(pair, header, parts, in_place, deadline)
        except BaseException:  # mid-exchange, the pair's message order is lost: never reuse it
            self._drop()
            raise
        self._last_used = time.monotonic()
        if in_place and status != _OK:
            self._drop()  # our pieces are still pending, and the receiver has dropped the pair
        if status == _DECLINED and in_place:
            logger.info("%s takes no chunks in place (%s): sending copies", self.endpoint, reason)
            self.sends_in_place = False
            return False
        if status == _REFUSED:
            raise TransferRefused(reason)
        if status != _OK:
            self._drop()
            raise ConnectionError(f"{self.endpoint}: {reason}")
        return True

    @staticmethod
    def _payload_tensor(payload: memoryview | bytes | torch.Tensor, receiver_device: str) -> torch.Tensor:
        if isinstance(payload, torch.Tensor):
            flat = payload.contiguous().view(-1).view(torch.uint8)
            return flat if flat.device.type == receiver_device == "cuda" else flat.cpu()
        view = memoryview(payload).cast("B")
        return torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)

    def _exchange(
        self, pair: _Pair, header: bytes, parts: list[torch.Tensor], in_place: bool, deadline: float
    ) -> tuple[int, str]:
        timeout_ms = int((deadline - time.monotonic()) * 1000)
        nbytes = sum(part.numel() for part in parts)
        on_device = int(parts[0].device.type == "cuda")
        view = memoryview(self._head.numpy())
        _HEAD.pack_into(view, 0, len(header), nbytes, timeout_ms, on_device, len(parts) if in_place else 0)
        view[_HEAD.size : _HEAD.size + len(header)] = header
        pair.send(self._head, deadline, "sending a chunk")
        if in_place:
            works = pair.post_all("send", parts)  # they move once the receiver posts its receives
            try:
                status, reason = _recv_verdict(pair, self._verdict, deadline)
                if status == _OK:
                    pair.wait_all(works, deadline, "sending a chunk payload")
            finally:
                works.clear()
            return status, reason
        if nbytes:
            status, reason = _recv_verdict(pair, self._verdict, deadline)
            if status != _OK:
                return status, reason
            pair.send_all(parts, deadline, "sending a chunk payload")
        return _recv_verdict(pair, self._verdict, deadline)

    def _pair_up(self, deadline: float, gpu: torch.device | None, header: bytes) -> None:
        end = min(deadline, time.monotonic() + self.config.connect_timeout_s)
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.endpoint}: no time left to pair up")
        try:  # fail fast (a TCPStore client retries a refused connect until its timeout) and learn our address
            with socket.create_connection((self.host, self.port), timeout=left) as probe:
                local = probe.getsockname()[0]  # the local address that routes to the receiver
        except OSError as exc:
            raise ConnectionError(f"no KV receiver at {self.endpoint}: {exc}") from None
        if self._stuck_handshake is not None and self._stuck_handshake.is_alive():
            raise ConnectionError(f"{self.endpoint}: the last pairing is still without an answer (a stopped receiver?)")
        hello = {
            "device": "cuda" if gpu is not None else "cpu",
            "gpu": _gpu_uuid(gpu) if gpu is not None else None,
            "header": bytes(header),  # proves a ticket: the receiver pairs with no one else
        }
        try:
            store, pair_id, verdict = self._handshake(hello, end)
            if not verdict["ok"]:
                if verdict.get("refused"):  # the chunk's own refusal (its header is not authentic)
                    raise TransferRefused(verdict["reason"])
                raise ConnectionError(f"{self.endpoint} refused to pair: {verdict['reason']}")
            pair = _Pair(store, pair_id, 1, local, end - time.monotonic(), self.config.nccl_timeout_s)
            if verdict.get("nccl") and gpu is not None:
                try:
                    pair.connect_nccl(gpu, end)
                except BaseException:
                    pair.close()
                    raise
            self._pair = pair
            self.num_connects += 1
        except RuntimeError as exc:  # DistError: store or rendezvous
            message = str(exc).splitlines()[0]
            kind = TimeoutError if "timeout" in message.lower() or "timed out" in message.lower() else ConnectionError
            raise kind(f"pairing with {self.endpoint}: {message}") from None
        self._pair_idle_s = verdict["pair_idle_s"]
        self._receiver_device = verdict["device"]
        # A receiver from before "nccl" makes its NCCL group lazily, on the first GPU payload.
        self._nccl = gpu is not None and bool(verdict.get("nccl", verdict["device"] == "cuda"))
        self._last_used = time.monotonic()

    def _handshake(self, hello: dict, end: float) -> tuple[dist.TCPStore, str, dict]:
        """The store's part of pairing, on a thread of its own bounded by ``end``: a TCPStore client
        waits without limit for a receiver that accepted the connection and then stopped answering
        (SIGSTOP, a wedged host), whatever timeout it is given. A handshake left behind ends when
        that receiver answers or dies; the channel starts no other meanwhile."""
        outcome: dict = {}

        def handshake() -> None:
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False, timeout=_td(end - time.monotonic()))
                pair_id = secrets.token_hex(16)
                store.set(f"pair/{pair_id}/hello", msgpack.packb(hello))
                store.queue_push(_QUEUE, pair_id)
                verdict_key = f"pair/{pair_id}/verdict"
                store.wait([verdict_key], _td(max(0.001, end - time.monotonic())))
                verdict = msgpack.unpackb(store.get(verdict_key))
                store.delete_key(verdict_key)
                store.delete_key(f"pair/{pair_id}/hello")
                outcome["value"] = (store, pair_id, verdict)
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=handshake, name="kv-torch-pairing", daemon=True)
        thread.start()
        thread.join(max(0.0, end - time.monotonic()))
        if thread.is_alive():
            self._stuck_handshake = thread
            raise TimeoutError(f"pairing with {self.endpoint}: no answer within the deadline (a stopped receiver?)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _drop(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class TorchDistTransport(KVTransport):
    name = "torch"

    def __init__(self, config: TorchDistConfig | None = None, **options) -> None:
        self.config = config if config is not None else TorchDistConfig(**options)
        self._endpoints: list[_Endpoint] = []

    def serve(self, receiver: KVReceiver, host: str = "127.0.0.1") -> str:
        endpoint = _Endpoint(receiver, host, self.config)
        self._endpoints.append(endpoint)
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        return f"torch://{host}:{endpoint.port}"

    def connect(self, endpoint: str) -> KVChannel:
        return _TorchDistChannel(endpoint, self.config)

    def num_pairs(self) -> int:
        """Sender pairs open on this transport's endpoints (a gauge for metrics)."""
        return sum(endpoint.num_pairs for endpoint in self._endpoints)

    def shutdown(self, join_s: float = 1.0) -> None:
        """Stops accepting, closes the stores and joins pair threads for up to ``join_s``."""
        for endpoint in self._endpoints:
            endpoint.shutdown(join_s)
        self._endpoints.clear()


@atexit.register
def _shutdown_at_exit() -> None:
    # A daemon thread that returns from torch's C++ after the interpreter began finalizing is torn
    # down inside a noexcept frame and aborts the process ("terminate called without an active
    # exception"). Stop the accept threads and let closing pairs finish first; pairs idling in a
    # recv stay parked in C++, which is safe unless their sender closes during those milliseconds.
    with _live_lock:
        endpoints = list(_live_endpoints)
    for endpoint in endpoints:
        endpoint.shutdown(join_s=0.5)


__all__ = ["TorchDistConfig", "TorchDistTransport"]
