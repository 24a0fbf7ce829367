"""Content hashes of full KV blocks, the keys of the prefix cache.

A block's hash chains its parent's hash, its tokens and (first block only) the request's
``cache_salt``: two requests share a block only when everything before it is identical, and
tenants with different salts never share anything. Torch-free, so that the router hashes a
prompt exactly as the engines do and looks it up in what each replica reports it holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import msgpack

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    payload = msgpack.packb([parent or b"", list(token_ids), salt or ""], use_bin_type=True)
    return hashlib.sha256(payload).digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, extending ``known`` (already computed)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt if start == 0 else None)
        hashes.append(parent)
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
