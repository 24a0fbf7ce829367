"""Content hashes of full KV blocks, the keys of the prefix cache.

A block's hash chains its parent's hash, its tokens and (first block only) the request's
``cache_salt``: two requests share a block only when everything before it is identical, and
tenants with different salts never share anything. Torch-free, so that the router hashes a
prompt exactly as the engines do and looks it up in what each replica reports it holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

BlockHash = bytes


_NO_PARENT = b"\0" * 32


def _head(parent: BlockHash | None, salt: str | None) -> bytes:
    """What precedes a block's tokens in its hash: its parent's hash, or for a first block 32 zero
    bytes and the salt (length-prefixed, so no salt and tokens can be mistaken for each other)."""
    if parent is not None:
        return parent
    encoded = (salt or "").encode()
    return _NO_PARENT + len(encoded).to_bytes(4, "little") + encoded


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """SHA-256 of the parent's hash (or the salt) and the tokens as 64-bit ints: computed from one
    bytes copy of the prompt, not a serialization per block (the router hashes every prompt)."""
    return hashlib.sha256(_head(parent, salt) + array("q", token_ids).tobytes()).digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, extending ``known`` (already computed)."""
    hashes = list(known)
    start = len(hashes) * block_size
    num_full = (len(token_ids) - start) // block_size
    if num_full <= 0:
        return hashes
    raw = array("q", token_ids[start : start + num_full * block_size]).tobytes()
    step = block_size * 8
    previous = _head(hashes[-1] if hashes else None, salt)
    for offset in range(0, len(raw), step):
        previous = hashlib.sha256(previous + raw[offset : offset + step]).digest()
        hashes.append(previous)
    return hashes


# What a replica reports of each cached block: the first bytes of its hash. 64 bits keep a
# collision (which would only make one placement slightly worse) out of reach.
SHORT_HASH_BYTES = 8


def short_hashes(block_hashes: Sequence[BlockHash]) -> list[bytes]:
    return [block_hash[:SHORT_HASH_BYTES] for block_hash in block_hashes]


def pack_short_hashes(short: Iterable[bytes]) -> bytes:
    """Short hashes laid end to end: a report's compact form of a replica's prefix cache."""
    return b"".join(short)


def unpack_short_hashes(packed: bytes) -> set[bytes]:
    """The set of short hashes in ``packed`` (a trailing partial hash is ignored)."""
    n = SHORT_HASH_BYTES
    return {packed[i : i + n] for i in range(0, len(packed) - n + 1, n)}
