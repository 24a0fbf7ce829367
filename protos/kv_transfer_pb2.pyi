from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Piece(_message.Message):
    __slots__ = ("header", "payload_size", "data", "in_place")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    payload_size: int
    data: bytes
    in_place: bool
    def __init__(self, header: _Optional[bytes] = ..., payload_size: _Optional[int] = ..., data: _Optional[bytes] = ..., in_place: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "reason", "declined")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    declined: bool
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., declined: _Optional[bool] = ...) -> None: ...
