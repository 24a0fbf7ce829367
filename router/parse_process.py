"""Large request bodies parsed in a process of their own, so that no parse holds the router's loop.

``json.loads`` holds the GIL from its first byte to its last. On a thread of the router's process,
a 26 MiB body of token ids (0.3 s to parse) held the event loop, and with it every stream's next
token, every deadline and every health answer, for as long: 0.26 s of loop lag per body, measured
(router.loop_lag), and a client can send them back to back. Here the router writes the body to a
child process over a pipe (the writes release the GIL) and waits; the child parses it, refuses it
as the router would (protocol's checks, then the prompt's bounds against the context), or answers
with the body re-encoded, only its known fields kept (``protocol.KNOWN_FIELDS``), which
protocol's parse reads alone. What comes back is thus an error or a body whose prompt is within the
context, which the router parses as it parses any body, so the result is the router's own parse.

Nothing is unpickled: JSON crosses both ways, framed by lengths. One child serves one body at a
time (a body waits for the one before it; bodies are bounded by ``max_body_bytes`` and admission).
A child that dies or overruns ``timeout_s`` is killed and replaced for the next body; the body it
held is answered 503.

    request   !II  header length, body length;  header JSON {kind, served_model, bounds};  body
    answer    !BI  verdict (0 parsed, 1 refused), payload length;  payload JSON
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import struct
import sys
from pathlib import Path

from common.errors import InvalidRequestError, OverloadedError
from router import protocol
from router.prompt_bounds import PromptBounds, check_bounds
from router.protocol import ApiError, RequestKind

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct("!II")
_ANSWER = struct.Struct("!BI")
_PARSED, _REFUSED = 0, 1
NICENESS = 10  # added to the router's: the child yields the CPU to the engines


def verdict(raw: bytes, kind: RequestKind, served_model: str, bounds: PromptBounds) -> tuple[int, bytes]:
    """The child's answer for one body: (_PARSED, the known fields re-encoded) or (_REFUSED, the
    refusal's fields)."""
    try:
        body = protocol.decode_body(raw)
        check_bounds(protocol.parse_request(body, served_model, kind), bounds)
    except ApiError as exc:
        refusal = {"class": "api", "status": exc.status, "message": exc.message, "type": exc.type}
        return _REFUSED, json.dumps(refusal | {"param": exc.param, "code": exc.code, "headers": exc.headers}).encode()
    except InvalidRequestError as exc:
        refusal = {"class": "invalid", "message": exc.message, "param": exc.param, "code": exc.code}
        return _REFUSED, json.dumps(refusal).encode()
    assert isinstance(body, dict)  # parse refused anything else
    known = {key: value for key, value in body.items() if key in protocol.KNOWN_FIELDS}
    return _PARSED, json.dumps(known, ensure_ascii=False).encode()


def refusal_from(payload: bytes) -> Exception:
    fields = json.loads(payload)
    if fields.pop("class") == "api":
        return ApiError(fields.pop("status"), fields.pop("message"), **fields)
    return InvalidRequestError(fields["message"], param=fields["param"], code=fields["code"])


def serve_forever(source, sink) -> None:  # type: ignore[no-untyped-def]
    """The child's loop: one body in, one verdict out, until the router closes the pipe. It runs
    at a lower CPU priority (NICENESS): a flood of huge bodies slows its own parsing, not the
    engines' steps on a host whose cores they share (measured: a minute of back-to-back 30 MiB
    bodies on the 2-core machine doubled the good clients' TTFT p99 at equal priority)."""
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    while header := source.read(_REQUEST.size):
        header_len, body_len = _REQUEST.unpack(header)
        meta = json.loads(source.read(header_len))
        raw = source.read(body_len)
        status, payload = verdict(raw, meta["kind"], meta["served_model"], PromptBounds(**meta["bounds"]))
        sink.write(_ANSWER.pack(status, len(payload)) + payload)
        sink.flush()


class ParseProcess:
    """The router's side: ``await reduce(...)`` refuses what the router would refuse, or gives a
    body that parses as the original does, in a time that does not grow with the original's size."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.num_parsed = 0
        self.num_restarts = 0

    async def reduce(self, raw: bytes, kind: RequestKind, served_model: str, bounds: PromptBounds) -> bytes:
        """The body's known fields, re-encoded, once the child found it a request within
        ``bounds``; else the refusal the router would have made, raised."""
        meta = json.dumps({"kind": kind, "served_model": served_model, "bounds": dataclasses.asdict(bounds)}).encode()
        async with self._lock:  # one body at a time per child: the answers come back in order
            try:
                async with asyncio.timeout(self.timeout_s):
                    child = await self._running()
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write(_REQUEST.pack(len(meta), len(raw)))
                    child.stdin.write(meta)
                    child.stdin.write(raw)
                    await child.stdin.drain()
                    status, length = _ANSWER.unpack(await child.stdout.readexactly(_ANSWER.size))
                    payload = await child.stdout.readexactly(length)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                # The body may be what broke it; it is not retried, nor is any other body held back.
                await self.close()
                self.num_restarts += 1
                logger.warning("the parse process failed on a %d-byte body (%r); it is replaced", len(raw), exc)
                raise OverloadedError("the request body could not be parsed this time; retry") from None
            except asyncio.CancelledError:
                # The client left mid-exchange: the pipe may hold half a frame, so start afresh.
                await self.close()
                raise
        self.num_parsed += 1
        if status == _REFUSED:
            raise refusal_from(payload)
        return payload

    async def start(self) -> None:
        """Start the child ahead of the first large body (its interpreter takes ~0.1 s)."""
        async with self._lock:
            await self._running()

    async def _running(self) -> asyncio.subprocess.Process:
        if self._child is None or self._child.returncode is not None:
            root = str(Path(__file__).resolve().parents[1])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "router.parse_process",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
                limit=2**16,
            )
        return self._child

    async def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(child.wait(), 5)


if __name__ == "__main__":
    serve_forever(sys.stdin.buffer, sys.stdout.buffer)
