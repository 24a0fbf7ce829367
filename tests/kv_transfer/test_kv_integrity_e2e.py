"""A KV payload corrupted on the wire, under each ``kv_integrity`` setting, between two real engines
over the real tcp transport: a proxy between them flips one byte of the first payload it carries.

    mac, crc32  the chunk is refused: the hand-off fails on both sides, the decode request ends
                with a ``kv_load_failed`` error (what router.kv_load_failure_policy acts on), and
                no block is left held
    none        nothing notices: the request decodes from the corrupted KV

And tampering that keeps the CRC (CRC-32 is linear: a change can be made to cancel out) passes
crc32 and is refused by mac, whose key the path does not have.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import zlib

import pytest

from bench.cuda_check import expect_hand_off
from common.config import CacheConfig, EngineConfig, EngineRole, KVConnectorConfig, ModelConfig, SchedulerConfig
from common.serving import KV_LOAD_FAILED
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer.protocol import payload_check, payload_matches
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow

CONNECTOR = "kv_transfer.connector:TransferConnector"
FLIP_AT = 4096  # bytes into the first connection: past the first chunk's header, inside its payload


class CorruptingProxy:
    """Forwards tcp connections to ``target``; flips one byte at FLIP_AT of the first one's
    sender-to-receiver stream."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.flipped = False
        self._first = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            corrupt, self._first = self._first, False
            threading.Thread(target=self._pump, args=(client, upstream, corrupt), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, corrupt: bool) -> None:
        offset = 0
        try:
            while data := source.recv(65536):
                if corrupt and offset <= FLIP_AT < offset + len(data):
                    data = bytearray(data)
                    data[FLIP_AT - offset] ^= 0x10
                    self.flipped = True
                offset += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def make_engine(model_dir, role: EngineRole, integrity: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir)),
            cache=CacheConfig(kv_cache_memory=32 * 2**20),
            scheduler=SchedulerConfig(role=role),
            kv_connector=KVConnectorConfig(
                CONNECTOR,
                {"backend": "tcp", "receive": role is EngineRole.DECODE, "integrity": integrity},
                push_every_chunk=False,
            ),
        )
    )


@pytest.mark.parametrize("integrity", ["mac", "crc32", "none"])
def test_a_payload_corrupted_on_the_wire_fails_its_hand_off_unless_nothing_checks_it(smol_dir, integrity):
    prefill = make_engine(smol_dir, EngineRole.PREFILL, integrity)
    decode = make_engine(smol_dir, EngineRole.DECODE, integrity)
    proxy = CorruptingProxy(decode.kv_endpoints[0])
    try:
        ids = prefill.tokenizer.encode(" ".join(PROMPTS) * 2)
        params = SamplingParams(temperature=0, max_tokens=4)
        ticket = expect_hand_off(decode, "r", ids, params, "tcp")
        ticket["receiver_endpoints"] = [proxy.endpoint]
        prefill.add_request("r", ids, params, kv_ticket=ticket)
        finished = {}
        # A deadline, not a count of steps: an idle decode step takes microseconds, and on a loaded
        # machine 2,000 of them ended before the tcp push had landed (CI at e297ecf).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
                break
            prefill.step()
            finished.update({o.request_id: o for o in decode.step() if o.finished})
        assert proxy.flipped
        assert "r" in finished, "the request neither finished nor failed within 60 s"
        output = finished["r"]
        if integrity == "none":
            assert output.error is None and len(output.outputs[0].token_ids) == 4
            assert not prefill.transfer_failures
        else:
            assert output.error is not None and output.error.startswith(f"{KV_LOAD_FAILED}: "), output.error
            assert "checksum" in output.error
            assert "r" in prefill.transfer_failures and decode.num_kv_transfer_failures == 1
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        decode.check_integrity()
    finally:
        proxy.close()
        prefill.shutdown()
        decode.shutdown()


def _crc_preserving_change(length: int) -> bytes:
    """A non-zero change of ``length`` bytes that leaves any payload's CRC-32 as it was: CRC-32 is
    affine over GF(2), so 33 single-bit changes have a subset whose effects cancel (elimination)."""
    zero = zlib.crc32(bytes(length))

    def effect(bit: int) -> int:
        change = bytearray(length)
        change[bit // 8] ^= 1 << (bit % 8)
        return zlib.crc32(bytes(change)) ^ zero

    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (effect, set of bits as a mask)
    for bit in range(8 * length):
        vector, used = effect(bit), 1 << bit
        while vector:
            pivot = vector.bit_length() - 1
            if pivot not in basis:
                basis[pivot] = (vector, used)
                break
            vector ^= basis[pivot][0]
            used ^= basis[pivot][1]
        else:
            change = bytearray(length)
            for b in range(8 * length):
                if used >> b & 1:
                    change[b // 8] ^= 1 << (b % 8)
            return bytes(change)
    raise AssertionError("no cancelling change found")


def test_tampering_that_keeps_the_crc_passes_crc32_and_not_mac():
    key = b"the ticket's secret, 32 bytes..."
    payload = bytes(range(256)) * 16
    change = _crc_preserving_change(len(payload))
    tampered = bytes(a ^ b for a, b in zip(payload, change, strict=True))
    assert tampered != payload
    crc, mac = payload_check("crc32", key, payload), payload_check("mac", key, payload)
    assert payload_matches(crc, key, tampered)  # crc32 catches corruption, not tampering
    assert not payload_matches(mac, key, tampered)
