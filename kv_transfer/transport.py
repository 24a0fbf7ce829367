"""The backend interface: how a chunk (signed header + payload) gets from a sender to a receiver.

Backends are found by name through a lazy registry, so an unused backend's dependencies
(grpc, torch.distributed groups, shared memory) never load.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from kv_transfer.errors import TransferRefused as TransferRefused  # where backends and tests import it from

if TYPE_CHECKING:
    from kv_transfer.receiving.direct import DirectWrite


class ChunkReceiver(Protocol):
    """What a backend needs from the receiver it serves (``kv_transfer.receiver.KVReceiver``): each
    method verifies a chunk and raises TransferRefused with the reason; see KVReceiver for the rest."""

    kv_caches: list[torch.Tensor]

    def apply(
        self,
        raw_header: bytes,
        payload: memoryview | bytes | torch.Tensor,
        regions: Mapping[int, torch.Tensor] | None = None,
    ) -> None: ...

    def check_header(self, raw_header: bytes, nbytes: int) -> None: ...

    def begin_direct(
        self, raw_header: bytes, nbytes: int, num_pieces: int | None, abort: Callable[[], object] | None = None
    ) -> DirectWrite: ...

    def end_direct(self, write: DirectWrite, received: bool, reason: str = "") -> None: ...

    def landing_stream(self) -> contextlib.AbstractContextManager[None]: ...


class KVChannel(ABC):
    """A sender's connection to one receiver endpoint. Used by one sender thread at a time."""

    sends_in_place = False  # whether ``send_pieces`` may take a chunk (checked before preparing one)
    # Whether a chunk sent with a ``tag`` may return before its verdict, once its memory may be
    # reused; ``collect`` then reports a refusal under the tag. A send without a tag always waits
    # for its own verdict, and reads the verdicts of the chunks before it first.
    pipelines = False
    sends_device_pieces = False  # whether ``send_pieces`` may take GPU tensors
    # Below this, a piece costs more as its own message than two copies of its bytes (~70 us a gloo
    # message, measured), so a sender copies several layers of such pieces into one payload instead.
    in_place_min_piece_bytes = 256 << 10
    # Connections (pairs) this channel has opened: one for as long as the receiver keeps it, a new
    # one after it was closed, idled out, or broke off mid-exchange.
    num_connects = 0

    @abstractmethod
    def send(self, header: bytes, payload: memoryview | bytes, timeout_s: float, tag: str | None = None) -> None:
        """Deliver one chunk and wait for the receiver's verdict (unless posted under ``tag``: see
        ``pipelines``). May block up to ``timeout_s``.

        Raises TransferRefused (the receiver said no), TimeoutError, or ConnectionError.
        """

    def pull_source(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """Optional one-sided path: (region id, byte offset) at which the receiver can read ``tensor``
        in place, sharing its memory region with the receiver first if needed; None if it cannot.
        The sender then sends a header naming the blocks and no payload: no copy on this side."""
        return None

    def pull_sources(self, tensors: list[torch.Tensor]) -> list[tuple[int, int] | None]:
        """``pull_source`` of each tensor (the layers of one chunk), with the connection checked once."""
        return [self.pull_source(tensor) for tensor in tensors]

    def post(self, header: bytes, tag: str, timeout_s: float) -> bool:
        """Optional pipelined path for a pulled chunk (no payload): deliver it without waiting for
        its verdict, which ``collect`` reports later under ``tag``. False if unsupported (then
        ``send`` it). May block up to ``timeout_s`` when too many verdicts are outstanding."""
        return False

    def collect(self, wait: bool, timeout_s: float) -> list[tuple[str, Exception]]:
        """The failures among posted chunks' verdicts received so far, as (tag, error); with
        ``wait``, every outstanding verdict first, each waited for at most until its own chunk's
        deadline (or ``timeout_s``). A broken connection fails every outstanding tag."""
        return []

    @property
    def num_posted(self) -> int:
        """Posted chunks whose verdicts are still outstanding."""
        return 0

    def send_pieces(self, header: bytes, pieces: list[torch.Tensor], timeout_s: float, tag: str | None = None) -> bool:
        """Optional zero-copy path: like ``send``, with the payload sent as these contiguous tensors
        (views of the sender's cache) one after another, for the receiver to take in place
        (``KVReceiver.begin_direct``). False if unsupported, or not for tensors on this device."""
        return False

    def send_spans(
        self,
        header: bytes,
        layers: list[torch.Tensor],
        spans: list[tuple[int, int]],
        timeout_s: float,
        tag: str | None = None,
    ) -> bool:
        """``send_pieces`` of the byte ranges ``spans`` ([offset, offset + length) each) of every one
        of ``layers`` (contiguous tensors viewed as flat bytes), layer after layer. A channel that
        sends raw buffers slices one view per layer here instead of making a tensor per piece."""
        pieces = []
        for kv in layers:
            flat = kv.view(-1).view(torch.uint8)
            pieces += [flat.narrow(0, offset, length) for offset, length in spans]
        return self.send_pieces(header, pieces, timeout_s, tag)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """Optional zero-copy path: a writable uint8 CPU tensor in the transport's own memory. A sender
        that fills it and calls ``send_staged`` saves one copy. Valid until the next send; None if absent."""
        return None

    def send_staged(self, header: bytes, nbytes: int, timeout_s: float, tag: str | None = None) -> None:
        """Like ``send``, with the payload already written into ``staging(nbytes)``."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection; idempotent."""


class KVTransport(ABC):
    name: str

    @abstractmethod
    def serve(self, receiver: ChunkReceiver, host: str = "127.0.0.1") -> str:
        """Start accepting chunks for ``receiver``; returns its endpoint string. Never blocks."""

    @abstractmethod
    def connect(self, endpoint: str) -> KVChannel:
        """A channel to a served endpoint (may connect lazily)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop serving; idempotent."""


_BACKENDS = {
    "inproc": "kv_transfer.backends.inproc:InProcTransport",
    "shm": "kv_transfer.backends.shm:SharedMemoryTransport",
    "grpc": "kv_transfer.backends.grpc_backend:GrpcTransport",
    "torch": "kv_transfer.backends.torch_dist:TorchDistTransport",
    "tcp": "kv_transfer.backends.tcp:TcpTransport",
    "auto": "kv_transfer.backends.auto:AutoTransport",  # shm on this host, tcp elsewhere
}


def available_backends() -> list[str]:
    return list(_BACKENDS)


def get_transport(name: str, **options) -> KVTransport:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; available: {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)


_DIALED_BY_HOST = ("tcp", "grpc", "torch")  # the backends whose endpoints are host:port
WILDCARDS = ("0.0.0.0", "::")  # bind every interface; an endpoint is then named by an advertised address


def advertised(endpoint: str, host: str | None) -> str:
    """``endpoint`` as peers on other hosts dial it: its port on ``host`` (the address the receiver
    is reachable at, when it binds every interface or sits behind NAT); an ``auto`` endpoint's
    tcp half. Endpoints without a host (``shm``, ``inproc``) and ``host=None`` leave it as it is."""
    scheme, _, rest = endpoint.partition("://")
    if host is not None and scheme == "auto":  # its tcp half is dialed by host
        local, _, network = rest.partition("|")
        return f"auto://{local}|{advertised(network, host)}"
    if host is None or scheme not in _DIALED_BY_HOST:
        return endpoint
    _, _, port = rest.rpartition(":")
    host = host.strip("[]")
    address = f"[{host}]" if ":" in host else host
    return f"{scheme}://{address}:{port}"
