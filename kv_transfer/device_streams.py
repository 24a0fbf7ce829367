"""Where KV moves on a GPU: on transfer streams of its own, ordered after compute by events.

The forward pass writes a layer's KV on the compute stream; ``layer_ready`` records an event there
right after (``KVSender.send_layer``, on the compute thread). The sending thread runs every device
operation of a push (gathers, copies to host memory, NCCL sends) on its own transfer stream, which
waits for that event first (``wait_for``); a receiving thread lands KV on its own transfer stream
too, and waits for it (``settle``: that stream alone, not the device) before a chunk counts as
landed. So the compute stream never waits on a transfer, and a decode step never reads blocks a
transfer is still writing. Host memory a transfer stages through is pinned and reused
(``HostStaging``), its copies non-blocking. Each such thread sets its CUDA device first: a pinned
buffer or a stream made on a thread that never did opens a context on GPU 0, whatever GPU the
shard owns.

On CPU every function here does nothing (the copies are synchronous there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()  # a thread's own transfer stream per device


def layer_ready(kv_layer: torch.Tensor) -> torch.cuda.Event | None:
    """On the compute thread, right after the layer's KV write was queued: an event the transfer
    stream waits for before reading the layer (None on CPU, where the write has happened)."""
    if kv_layer.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv_layer.device))
    return event


def transfer_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's transfer stream on ``device`` (made on first use, kept)."""
    streams: dict[int, torch.cuda.Stream] | None = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))
    return stream


@contextlib.contextmanager
def on_transfer_stream(device: torch.device | None) -> Iterator[None]:
    """Run the block's device work on this thread's transfer stream of ``device`` (CUDA), with the
    thread's current device set to it for the block (restored after: the inproc transport lands a
    receiver's chunk on the sender's thread, maybe on another GPU); on CPU (or None) as it is."""
    if device is None or device.type != "cuda":
        yield
        return
    outer = getattr(_local, "device", None)
    _local.device = device
    try:
        with torch.cuda.device(device), torch.cuda.stream(transfer_stream(device)):
            yield
    finally:
        _local.device = outer


def current_transfer_device() -> torch.device | None:
    """The GPU whose transfer stream this thread is on now (inside ``on_transfer_stream``), else None:
    what a transport tells a peer when it pairs, as where this side's KV lives."""
    return getattr(_local, "device", None)


def wait_for(event: torch.cuda.Event | None, device: torch.device) -> None:
    """``device``'s current (transfer) stream waits for ``event``; the host does not."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def settle(device: torch.device | None) -> None:
    """The host waits until the work queued so far on this thread's current stream has run: that
    stream only (an event on it), never the whole device."""
    if device is not None and device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


class HostStaging:
    """Reusable host memory for one thread's (or one lock holder's) device<->host copies: pinned
    where CUDA is, so the copies are DMA and non-blocking on the transfer stream. A buffer may be
    reused once the copy through it settled (the caller's ``settle``)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._reading: dict[str, torch.cuda.Event] = {}  # a non-blocking copy still reading the buffer

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        reading = self._reading.pop(key, None)
        if reading is not None:  # the last copy out of it must have read it before it is written again
            reading.synchronize()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            # Grown by half again, so a run of slightly larger chunks does not pin anew each time.
            size = max(nbytes, int(buf.numel() * 1.5) if buf is not None else 0)
            buf = self._buffers[key] = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buf[:nbytes]

    def to_host(self, tensor: torch.Tensor, key: str = "out") -> torch.Tensor:
        """``tensor`` (on a GPU) in this staging's host memory, copied on the current stream and
        settled; a CPU tensor is returned as it is."""
        if tensor.device.type != "cuda":
            return tensor
        source = tensor.contiguous()
        host = self.buffer(key, source.numel() * source.element_size()).view(source.dtype).view(source.shape)
        host.copy_(source, non_blocking=True)
        settle(tensor.device)
        return host

    def to_device(self, tensor: torch.Tensor, device: torch.device, key: str = "in") -> torch.Tensor:
        """A host ``tensor`` on ``device``, through pinned memory with a non-blocking copy on the
        current stream (the buffer's next use waits for that copy, not for the stream)."""
        if device.type != "cuda":
            return tensor if tensor.device == device else tensor.to(device)
        host = self.buffer(key, tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)
        moved = host.to(device, non_blocking=True)
        read = torch.cuda.Event()
        read.record(torch.cuda.current_stream(device))
        self._reading[key] = read
        return moved
