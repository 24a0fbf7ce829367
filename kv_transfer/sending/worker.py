"""The sending thread and its bounded queue: the compute thread only enqueues, this thread sends.

The queue is bounded: a sender that cannot keep up blocks the enqueue up to the ticket's lease
(at most ``_MAX_ENQUEUE_WAIT_S``), then fails the push instead of buffering without limit. The
thread takes the items in order, one push at a time; a push's layers already waiting behind the
one taken leave with it. Any failure ends that push, never the thread. Between items, and while
idle, it reads the verdicts posted chunks owe.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading

from common.openmp import run_tensor_ops_serially
from kv_transfer.device_streams import on_transfer_stream, wait_for
from kv_transfer.sending.book import PushBook
from kv_transfer.sending.channels import Channels
from kv_transfer.sending.items import CancelItem, DoneItem, LayerItem, WindowItem, WorkItem
from kv_transfer.sending.pusher import Pusher

logger = logging.getLogger("kv_transfer.sender")  # the name operators filter a sender's failures by

_MAX_ENQUEUE_WAIT_S = 5.0
_MAX_LAYERS_PER_CHUNK = 64  # layers one pulled chunk may name
_SETTLE_EVERY_S = 0.005  # how often an idle sender reads the verdicts of chunks it posted


class SendWorker:
    def __init__(self, name: str, max_queue: int, book: PushBook, channels: Channels, pusher: Pusher) -> None:
        self.book = book
        self.channels = channels
        self.pusher = pusher
        self._queue: queue.Queue[WorkItem | None] = queue.Queue(maxsize=max_queue)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def enqueue(self, item: WorkItem) -> None:
        """On the compute thread: queue ``item`` unless its push ended."""
        push = self.book.get(item.request_id)
        if push is None or push.state.is_terminal:
            return
        # Called from the forward pass: wait a little for room, never for a whole lease.
        timeout = min(_MAX_ENQUEUE_WAIT_S, push.ticket.lease_left_s())
        try:
            self._queue.put(item, timeout=timeout)
        except queue.Full:
            self.book.fail(push, f"send queue still full after {timeout:.1f} s")

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wakes an idle thread; a busy one sees _stopping
        self._thread.join(timeout=10)

    def _run(self) -> None:
        run_tensor_ops_serially()  # the engine thread owns the process's OpenMP team
        channels = self.channels
        held: list[WorkItem | None] = []  # an item taken off the queue while batching, handled next
        while not self._stopping:
            if held:
                item = held.pop()
            else:
                try:
                    # Verdicts outstanding: read them as they come, without holding up the next layer.
                    item = self._queue.get(timeout=_SETTLE_EVERY_S if channels.posting else None)
                except queue.Empty:
                    channels.collect()
                    continue
            if item is None:
                return
            layers: list[LayerItem] = []
            if isinstance(item, LayerItem):
                layers = self._layers_behind(item, held)
            push = self.book.take(item.request_id)
            if push is None:
                continue
            try:
                match item:
                    case LayerItem():
                        # On the transfer stream, after the compute stream wrote each layer.
                        with on_transfer_stream(item.kv_layer.device):
                            for layer in layers:
                                wait_for(layer.ready, layer.kv_layer.device)
                            self.pusher.send_layers(push, layers)
                    case WindowItem():
                        self.book.open_window(push, item.src_block_ids)
                    case CancelItem():
                        self.book.fail(push, item.reason)
                    case DoneItem():
                        self.pusher.send_done(push, item.first_token_id)
            except Exception as exc:  # any transport failure ends this request, never the thread
                logger.warning("KV transfer of %s failed: %s", item.request_id, exc)
                if channels.posting:
                    channels.collect()  # an earlier refusal is the root cause: it names it first
                self.book.fail(push, f"{type(exc).__name__}: {exc}")
            finally:
                self.book.put_down()
            if channels.posting:
                channels.collect()

    def _layers_behind(self, first: LayerItem, held: list[WorkItem | None]) -> list[LayerItem]:
        """``first`` and the layers of its request already waiting behind it (the sender fell behind
        the forward pass): they leave together, one chunk, one verdict and one signature instead of
        one each. The item that ends the run, taken off the queue, goes to ``held``."""
        layers = [first]
        while len(layers) < _MAX_LAYERS_PER_CHUNK:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, LayerItem) or item.request_id != first.request_id:
                held.append(item)
                break
            layers.append(item)
        return layers
