"""The refusals a receiver answers a chunk with; a backend carries them back to the sender."""

from __future__ import annotations


class TransferRefused(Exception):
    """The receiver refused a chunk (bad signature, expired lease, checksum, layout); the reason says why.

    ``kind`` names the refusal as the receiver counts it (``KVReceiver.refusals``), "" if unknown."""

    def __init__(self, message: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


class NotInPlace(TransferRefused):
    """This receiver cannot take the chunk in place; the sender may send it to be copied instead."""
