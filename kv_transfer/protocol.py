"""The wire format every backend carries: a signed msgpack header, then raw payload bytes.

    chunk   = header (msgpack map, includes "mac") + payload (a layer's KV for some heads, raw)
    header  = {kind: "layer"|"done", request_id, layer, sender_rank, sender_tp, receiver_rank,
               dst_head_offset, num_heads, block_offset, num_blocks, nbytes, checksum|None,
               first_token_id|None, windows|None (a "done"), src_region, src_offset, ...
               (a pulled chunk: where the receiver reads the blocks)}
    mac     = HMAC-SHA256(ticket secret, msgpack(header without mac))

A transfer's blocks may leave in windows: consecutive ranges of the ticket's blocks, each sent
layer by layer (a prefill pushes each chunk's completed blocks while the next chunk computes).
A layer chunk names its window (``block_offset``, ``num_blocks``); the "done" lists every window
as [block_offset, num_blocks], and they must tile the ticket's blocks (None: one window, all).

The payload's check sits inside the authenticated header, so a forged header is refused and a
payload that does not match its check is refused too. The check is the sender's choice (the
``integrity`` of kv_transfer.sender), and the receiver verifies whichever the signed header carries:

    none    no check of the payload (the header is still signed)
    crc32   an int: CRC-32 of the payload. Catches corruption, not tampering: anyone on the path
            who can change the payload can make its CRC match
    mac     32 bytes: a random 16-byte nonce, then the payload's Poly1305 tag under a key used
            for this payload only, HMAC-SHA256(ticket secret, label + nonce). Catches both.
            Poly1305 runs at ~10-13 GB/s on one core where HMAC-SHA256 ran at ~1.8 (docs/security.md
            "KV integrity"); a Poly1305 key must never tag two messages, hence the one-time key

A receiver may require a check at least as strong as its own ``require_integrity`` (the cluster's
``kv_integrity``): a chunk carrying a weaker one fails its transfer, so a sender configured apart
from its receivers is found at the first chunk, not trusted silently.

Nothing is unpickled: headers are msgpack, payloads are reinterpreted as tensors of the ticket's
dtype and shape.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import zlib
from dataclasses import dataclass, fields

import msgpack
from cryptography.hazmat.primitives.poly1305 import Poly1305

MAX_DIRECT_RUNS = 8  # a payload received in place comes in a piece per run; more runs, and it is copied
MAX_DIRECT_PIECES = 256  # pieces (K or V of one run of one layer) in one chunk received in place


class ProtocolError(Exception):
    """A chunk that must not be written: bad signature, bad checksum, malformed header."""


# Not frozen: a receiver builds one per layer of a batched chunk, and a frozen dataclass's
# constructor costs ~4x as much (2.6 against 0.7 us a header, ~30 per chunk). Nothing mutates one.
@dataclass(slots=True)
class ChunkHeader:
    kind: str  # "layer" or "done"
    request_id: str
    sender_rank: int
    sender_tp: int
    receiver_rank: int
    layer: int = -1
    dst_head_offset: int = 0
    num_heads: int = 0
    block_offset: int = 0  # the window's first block, as an index into the ticket's blocks
    num_blocks: int = 0  # the window's blocks
    nbytes: int = 0
    checksum: int | bytes | None = None  # CRC-32 (int) or keyed MAC (bytes) of the payload
    first_token_id: int | None = None
    num_layers_sent: int = 0
    windows: list[list[int]] | None = None  # a "done": [block_offset, num_blocks] of every window sent
    # A pulled chunk carries no payload: the receiver reads the sender's blocks in place, from a
    # memory region the transport shared with it (the same-host backend). The layer tensor of
    # [2, src_num_blocks, block_size, src_heads, head_dim] starts at src_offset in region src_region.
    src_region: int = -1  # -1: the payload follows the header
    src_offset: int = 0
    src_num_blocks: int = 0
    src_heads: int = 0
    src_head_offset: int = 0
    src_block_ids: list[int] | None = None
    # A chunk received in place: its blocks (in ticket order) split into runs of these lengths,
    # each run consecutive on both sides; the payload is K then V of each run, run by run.
    run_lengths: list[int] | None = None
    # A pulled chunk may name several layers (those queued at the sender): [layer, src_region,
    # src_offset, checksum] each, in place of the single layer above.
    batch: list[list[int | bytes | None]] | None = None

    @property
    def pulled(self) -> bool:
        return self.src_region >= 0


_FIELDS = tuple(f.name for f in fields(ChunkHeader))


INTEGRITY_MODES = ("none", "crc32", "mac")  # weakest first
_NONCE_BYTES = 16
_TAG_BYTES = 16
_PAYLOAD_KEY_LABEL = b"pdserve/kv-payload-key\x00"  # the one-time keys never collide with a header's MAC
# Poly1305 holds the GIL while it hashes one update: slices of 1 MiB (~0.1 ms) keep the engine's
# thread running beside a sender's or receiver's.
_SLICE_BYTES = 1 << 20


def checksum(*parts: bytes | memoryview) -> int:
    """CRC-32 of the parts taken one after another, as one payload (a payload sent in pieces)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def payload_mac(key: bytes, *parts: bytes | memoryview, nonce: bytes | None = None) -> bytes:
    """nonce + Poly1305 tag of the parts as one payload, under a one-time key derived from ``key``
    (the ticket's secret) and a fresh random nonce (``nonce`` given: to verify a received tag)."""
    nonce = os.urandom(_NONCE_BYTES) if nonce is None else nonce
    one_time_key = hmac.new(key, _PAYLOAD_KEY_LABEL + nonce, digestmod=hashlib.sha256).digest()
    poly = Poly1305(one_time_key)
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), _SLICE_BYTES):
            poly.update(view[start : start + _SLICE_BYTES])
    return nonce + poly.finalize()


def payload_check(integrity: str, key: bytes, *parts: bytes | memoryview) -> int | bytes | None:
    """What a header carries for this payload under ``integrity`` (one of INTEGRITY_MODES)."""
    if integrity == "mac":
        return payload_mac(key, *parts)
    return checksum(*parts) if integrity == "crc32" else None


def integrity_of(check: int | bytes | None) -> str:
    """The mode (one of INTEGRITY_MODES) a header's payload check belongs to."""
    if check is None:
        return "none"
    return "mac" if isinstance(check, bytes) else "crc32"


def at_least(check: int | bytes | None, required: str) -> bool:
    """Whether a payload check is as strong as ``required`` (none < crc32 < mac)."""
    return INTEGRITY_MODES.index(integrity_of(check)) >= INTEGRITY_MODES.index(required)


def payload_matches(expected: int | bytes | None, key: bytes, *parts: bytes | memoryview) -> bool:
    """Whether the payload passes the check its (authenticated) header carries."""
    if expected is None:
        return True
    if isinstance(expected, bytes):
        if len(expected) != _NONCE_BYTES + _TAG_BYTES:
            return False
        return hmac.compare_digest(payload_mac(key, *parts, nonce=expected[:_NONCE_BYTES]), expected)
    return checksum(*parts) == expected


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def encode_header(header: ChunkHeader, secret: bytes) -> bytes:
    # Not dataclasses.asdict: it deep-copies every field, ~100 us a header on the per-layer path.
    body = msgpack.packb({name: getattr(header, name) for name in _FIELDS}, use_bin_type=True)
    return msgpack.packb({"body": body, "mac": _mac(secret, body)}, use_bin_type=True)


def peek_request_id(raw: bytes) -> str:
    """The request id of a chunk, read before authentication to find the ticket's secret."""
    try:
        outer = msgpack.unpackb(raw, raw=False)
        return str(msgpack.unpackb(outer["body"], raw=False)["request_id"])
    except Exception as exc:  # any malformed input is a protocol error, never a crash
        raise ProtocolError(f"malformed chunk header: {exc}") from exc


def decode_header(raw: bytes, secret: bytes) -> ChunkHeader:
    try:
        outer = msgpack.unpackb(raw, raw=False)
        body, mac = outer["body"], outer["mac"]
    except Exception as exc:
        raise ProtocolError(f"malformed chunk header: {exc}") from exc
    if not hmac.compare_digest(_mac(secret, body), mac):
        raise ProtocolError("chunk signature does not match the ticket's secret")
    try:
        return ChunkHeader(**msgpack.unpackb(body, raw=False))
    except Exception as exc:
        raise ProtocolError(f"malformed chunk header: {exc}") from exc
