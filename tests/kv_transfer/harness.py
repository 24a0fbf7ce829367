"""Builds sender and receiver shards of any TP degree over random KV, for transfer tests and benches."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import msgpack
import torch

from common.kv_layout import KVCacheLayout
from engine.kv_cache_memory import allocate_kv_caches, release_kv_caches
from kv_transfer import KVReceiver, KVSender, TransferState, make_ticket
from kv_transfer.backends.shm import SharedMemoryTransport
from kv_transfer.protocol import ChunkHeader
from kv_transfer.resharding import shard_heads
from kv_transfer.ticket import KVTicket
from kv_transfer.transport import KVTransport, get_transport

OPEN_REGIONS: list = []  # shared caches made by make_side; tests/kv_transfer/conftest.py releases them


def layer_chunk_header(**fields) -> ChunkHeader:
    """A hand-made chunk header (not from a KVSender): layer 0 of "req-1" from sender 0 of TP 1 to
    receiver 0, unless ``fields`` say otherwise."""
    base = dict(kind="layer", request_id="req-1", sender_rank=0, sender_tp=1, receiver_rank=0, layer=0)
    return ChunkHeader(**{**base, **fields})


def release_regions() -> None:
    while OPEN_REGIONS:
        release_kv_caches(OPEN_REGIONS.pop())


class PullShm(SharedMemoryTransport):
    """The shm backend, in tests whose sender caches live in shared memory: chunks are pulled."""


def transport_named(name: str) -> KVTransport:
    """A backend by name; "shm-pull" is shm with senders' caches in shared memory (see ``pulls``)."""
    return PullShm() if name == "shm-pull" else get_transport(name)


def pulls(transport: KVTransport) -> bool:
    return isinstance(transport, PullShm)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def layout_for(
    tp: int, rank: int, *, num_layers=3, total_kv_heads=2, head_dim=8, block_size=4, num_blocks=32, dtype="float32"
) -> KVCacheLayout:
    return KVCacheLayout(
        num_layers=num_layers,
        num_kv_heads=max(1, total_kv_heads // tp),
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=dtype,
        total_kv_heads=total_kv_heads,
        tp_size=tp,
        tp_rank=rank,
    )


@dataclass
class Side:
    layouts: list[KVCacheLayout]
    caches: list[list[torch.Tensor]]  # [shard][layer]


def make_side(
    tp: int, *, fill: bool, seed: int = 0, shared: bool = False, **shape
) -> tuple[Side, list[torch.Tensor] | None]:
    """Shards of one replica. With ``fill``, every shard holds its heads of one random global cache;
    with ``shared``, each shard's cache sits in a shared memory region, as a prefill engine's does."""
    layouts = [layout_for(tp, r, **shape) for r in range(tp)]
    base = layouts[0]
    dtype = DTYPES[base.dtype]
    full = None
    if fill:
        g = torch.Generator().manual_seed(seed)
        full = [
            torch.randn(2, base.num_blocks, base.block_size, base.total_kv_heads, base.head_dim, generator=g).to(dtype)
            for _ in range(base.num_layers)
        ]
    caches = []
    for layout in layouts:
        heads = shard_heads(layout.tp_rank, tp, base.total_kv_heads)
        layers, region = allocate_kv_caches(
            layout.layer_shape, base.num_layers, dtype, torch.device("cpu"), shared=shared
        )
        if region is not None:
            OPEN_REGIONS.append(region)
        if full is not None:
            for layer, whole in zip(layers, full, strict=True):
                layer.copy_(whole[:, :, :, heads.start : heads.stop])
        caches.append(layers)
    return Side(layouts, caches), full


def transfer(
    transport: KVTransport,
    sender_tp: int,
    receiver_tp: int,
    *,
    num_tokens=13,
    src_blocks=None,
    dst_blocks=None,
    lease_s=30.0,
    seed=0,
    integrity="crc32",
    windows: list[int] | None = None,
    through_wire: bool = False,
    before_send=None,
    **shape,
):
    """Run one full transfer; returns (receivers, senders, ticket, full source cache, dst side).
    ``windows``: the blocks of each window the transfer leaves in, in order (None: one window).
    ``through_wire``: the senders get the ticket as another process would (msgpack of to_dict).
    ``before_send(ticket)``: called once the receivers hold the ticket, before any sender starts."""
    src, full = make_side(sender_tp, fill=True, seed=seed, shared=pulls(transport), **shape)
    dst, _ = make_side(receiver_tp, fill=False, **shape)
    receivers = [KVReceiver(dst.caches[r], dst.layouts[r], transport.name) for r in range(receiver_tp)]
    endpoints = [transport.serve(rx) for rx in receivers]
    nb = -(-num_tokens // src.layouts[0].block_size)
    src_blocks = src_blocks or list(range(5, 5 + nb))
    dst_blocks = dst_blocks or list(range(20, 20 + nb))[::-1]
    ticket = make_ticket("req-1", transport.name, endpoints, dst.layouts[0], "m", dst_blocks, num_tokens, lease_s)
    for rx in receivers:
        rx.expect(ticket)
    senders = [KVSender(src.layouts[s], "m", transport, integrity=integrity) for s in range(sender_tp)]
    if before_send is not None:
        before_send(ticket)
    sent_ticket = ticket
    if through_wire:
        wire = msgpack.packb(ticket.to_dict(), use_bin_type=True)
        sent_ticket = KVTicket.from_dict(msgpack.unpackb(wire, raw=False))
    for s, sender in enumerate(senders):
        start = 0
        for i, count in enumerate(windows or [nb]):
            if i == 0:
                sender.start(sent_ticket, src_blocks[:count])
            else:
                sender.next_window(ticket.request_id, src_blocks[start : start + count])
            start += count
            for layer, kv in enumerate(src.caches[s]):
                sender.send_layer(ticket.request_id, layer, kv)
        sender.finish(ticket.request_id, first_token_id=42)
    return receivers, senders, ticket, full, dst, src_blocks


def wait_terminal(pollers, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [p() for p in pollers]
        if all(s.state.is_terminal for s in states):
            return states
        time.sleep(0.005)
    return [p() for p in pollers]


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def assert_bit_exact(full, dst: Side, src_blocks, dst_blocks, num_blocks):
    base = dst.layouts[0]
    for r, layout in enumerate(dst.layouts):
        heads = shard_heads(r, layout.tp_size, base.total_kv_heads)
        for layer in range(base.num_layers):
            expected = full[layer][:, src_blocks[:num_blocks], :, heads.start : heads.stop]
            got = dst.caches[r][layer][:, list(dst_blocks[:num_blocks])]
            assert torch.equal(got, expected), f"receiver shard {r} layer {layer} differs"


__all__ = [
    "PullShm",
    "TransferState",
    "assert_bit_exact",
    "layer_chunk_header",
    "layout_for",
    "make_side",
    "pulls",
    "replace",
    "transfer",
    "transport_named",
    "wait_terminal",
    "wait_until",
]


def made_transports(cls):
    """The body of a ``transports`` fixture: yields ``make(**options)``, which builds a transport of
    ``cls`` (server side and client side are kept apart, as in two processes); all are shut down after."""
    made = []

    def make(**options):
        made.append(cls(**options))
        return made[-1]

    yield make
    for transport in made:
        transport.shutdown()


def a_killed_receiver_fails_the_sender(
    transport: KVTransport, ticket: KVTicket, kill, src_blocks: list[int], layers_before: int, shared: bool = False
):
    """Push ``layers_before`` layers under ``ticket`` to a receiver in another process, wait until
    they are sent, ``kill()`` it, push the rest and the "done": the push must end FAILED, not for
    its lease. Returns its status and the seconds from the kill to its end (each backend has its bound)."""
    src, _ = make_side(1, fill=True, shared=shared)
    sender = KVSender(src.layouts[0], "m", transport)
    request_id = ticket.request_id
    sender.start(ticket, src_blocks)
    for layer in range(layers_before):
        sender.send_layer(request_id, layer, src.caches[0][layer])
    assert wait_until(lambda: sender.poll(request_id).layers_sent >= layers_before, 10), sender.poll(request_id)
    assert sender.poll(request_id).state is TransferState.TRANSFERRING
    kill()
    killed = time.monotonic()
    for layer in range(layers_before, src.layouts[0].num_layers):
        sender.send_layer(request_id, layer, src.caches[0][layer])
    sender.finish(request_id, 0)
    (status,) = wait_terminal([lambda: sender.poll(request_id)], timeout_s=20)
    seconds = time.monotonic() - killed
    sender.close()
    assert status.state is TransferState.FAILED and status.reason, status
    assert "lease" not in status.reason and not ticket.is_expired(), status  # the dead peer, not the lease
    return status, seconds


def engine_pair(make_engine, model_dir, backend: str = "inproc", **options):
    """A prefill and a decode engine (``make_engine(model_dir, role, tp, backend, ...)``), shut down
    on leaving; the decode one receives."""
    import contextlib

    from common.config import EngineRole

    @contextlib.contextmanager
    def pair():
        prefill = make_engine(model_dir, EngineRole.PREFILL, 1, backend, **options)
        try:
            decode = make_engine(model_dir, EngineRole.DECODE, 1, backend, receive=True)
            try:
                yield prefill, decode
            finally:
                decode.shutdown()
        finally:
            prefill.shutdown()

    return pair()


def reserve_with_ticket(decode, request_id: str, ids: list[int], params, lease_s: float, backend: str = "inproc"):
    """Reserve blocks on ``decode`` for a prompt and make the ticket prefill pushes under (a dict;
    not yet registered: the caller's ``expect_kv`` does that, as given or altered)."""
    block_ids = decode.reserve(request_id, ids, params)
    assert block_ids is not None, f"{request_id}: no room on the decode engine"
    ticket = make_ticket(
        request_id, backend, decode.kv_endpoints, decode.layout, decode.model_id, block_ids, len(ids), lease_s
    )
    return ticket.to_dict()
