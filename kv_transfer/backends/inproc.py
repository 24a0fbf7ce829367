"""In-process transport: the receiver is called directly. For unit tests and single-process debugging."""

from __future__ import annotations

import itertools
import threading

from kv_transfer.receiver import KVReceiver
from kv_transfer.transport import KVChannel, KVTransport

_registry: dict[str, KVReceiver] = {}
_ids = itertools.count()
_lock = threading.Lock()


class _InProcChannel(KVChannel):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def send(self, header, payload, timeout_s, tag=None):
        receiver = _registry.get(self.endpoint)
        if receiver is None:
            raise ConnectionError(f"no receiver at {self.endpoint}")
        receiver.apply(bytes(header), payload)


class InProcTransport(KVTransport):
    name = "inproc"

    def __init__(self) -> None:
        self._served: list[str] = []

    def serve(self, receiver: KVReceiver, host: str = "127.0.0.1") -> str:
        with _lock:
            endpoint = f"inproc://{next(_ids)}"
            _registry[endpoint] = receiver
        self._served.append(endpoint)
        return endpoint

    def connect(self, endpoint: str) -> KVChannel:
        return _InProcChannel(endpoint)

    def shutdown(self) -> None:
        with _lock:
            for endpoint in self._served:
                _registry.pop(endpoint, None)
        self._served.clear()
