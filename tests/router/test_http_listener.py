"""router.http_listener: a real uvicorn server on a real socket, driven by raw HTTP clients."""

from __future__ import annotations

import asyncio
import socket

import pytest

from router.http_listener import HttpListener, listening_socket


def _app(name: str, release: asyncio.Event | None = None):
    """An ASGI app answering its name; /slow streams one chunk, waits for ``release``, then ends."""

    async def app(scope, receive, send):
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if scope["path"] == "/slow":
            await send({"type": "http.response.body", "body": b"first;", "more_body": True})
            assert release is not None
            await release.wait()
        await send({"type": "http.response.body", "body": name.encode()})

    return app


async def _get(port: int, path: str = "/") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return int(head.split()[1]), body


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, body = out + body[:size], body[size + 2 :]
    return out


async def _wait_serving(listener: HttpListener) -> None:
    for _ in range(100):
        try:
            await _get(listener.port)
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise AssertionError("the listener never answered")


def test_serves_on_the_given_port_and_stop_refuses_new_connections():
    async def main():
        listener = HttpListener(_app("one"), "127.0.0.1", 0)
        listener.start()
        await _wait_serving(listener)
        assert listener.serving and listener.failure() is None
        assert await _get(listener.port) == (200, b"one")
        await listener.stop()
        assert not listener.serving and listener.failure() is None
        with pytest.raises(OSError):
            await _get(listener.port)

    asyncio.run(main())


def test_a_replacement_binds_beside_the_old_one_which_finishes_its_stream_after_stop():
    async def main():
        release = asyncio.Event()
        old = HttpListener(_app("old", release), "127.0.0.1", 0)
        old.start()
        await _wait_serving(old)
        reader, writer = await asyncio.open_connection("127.0.0.1", old.port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"first;"), 10)  # the stream has started
        new = HttpListener(_app("new"), "127.0.0.1", old.port)  # SO_REUSEPORT: no EADDRINUSE
        new.start()
        await _wait_serving(new)
        assert old.accepting
        stopping = asyncio.create_task(old.stop())
        for _ in range(500):  # the old server closes its listening socket first
            if not old.accepting:
                break
            await asyncio.sleep(0.01)
        assert not old.accepting and not stopping.done()  # ... but waits for its stream
        answers = {await _get(old.port) for _ in range(8)}
        assert answers == {(200, b"new")}  # every new connection goes to the replacement
        release.set()
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert head.split()[1] == b"200" and _dechunk(head.partition(b"\r\n\r\n")[2] + rest) == b"first;old"
        await stopping
        await new.stop()

    asyncio.run(main())


def test_a_port_held_by_a_server_without_reuseport_fails_at_construction():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", other.getsockname()[1])


def test_the_server_failing_shows_in_failure():
    async def main():
        listener = HttpListener(_app("x"), "127.0.0.1", 0)
        listener.socket.close()  # the server cannot serve a closed socket
        listener.start()
        for _ in range(100):
            if not listener.serving:
                break
            await asyncio.sleep(0.05)
        assert not listener.serving and listener.failure() is not None

    asyncio.run(main())


def test_sockets_that_never_finish_their_headers_are_closed_and_leave_room_for_others():
    """With room for 4 connections, 8 sockets that connect and trickle half a request line (or
    send nothing) are closed within the header deadline; a normal request then gets its 200, and
    a connection that finished its headers in time is not cut (its slow response completes)."""

    async def main() -> None:
        release = asyncio.Event()
        listener = HttpListener(
            _app("a", release), "127.0.0.1", 0, max_connections=4, header_timeout_s=0.5, drain_timeout_s=2.0
        )
        listener.start()
        try:
            slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", listener.port)
            slow_writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            await slow_writer.drain()
            assert (await asyncio.wait_for(slow_reader.readuntil(b"first;"), 10)).endswith(b"first;")
            idle = [await asyncio.open_connection("127.0.0.1", listener.port) for _ in range(8)]
            for i, (_, writer) in enumerate(idle):
                if i % 2:
                    writer.write(b"GET / HT")  # a header never finished
                    await writer.drain()
            # Closed by the server: each reads EOF (b"") well within 10 s, not a response.
            ends = await asyncio.gather(*(asyncio.wait_for(reader.read(), 10) for reader, _ in idle))
            assert all(b"HTTP/1.1" not in end for end in ends), ends
            assert await _get(listener.port) == (200, b"a")
            await asyncio.sleep(1.0)  # past the deadline: the slow response's connection stays
            release.set()
            assert (await asyncio.wait_for(slow_reader.read(), 10)).rstrip(b"\r\n0").endswith(b"a")
            for _, writer in [*idle, (slow_reader, slow_writer)]:
                writer.close()
        finally:
            release.set()
            await listener.stop()

    asyncio.run(main())


def _self_signed(tmp_path) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1, made now (cryptography: a dependency of pdserve)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    keyfile, certfile = tmp_path / "key.pem", tmp_path / "cert.pem"
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(keyfile), str(certfile)


def test_with_a_key_and_certificate_it_serves_https_only(tmp_path):
    import ssl

    from router.http_listener import TlsFiles

    keyfile, certfile = _self_signed(tmp_path)

    async def main():
        listener = HttpListener(_app("secure"), "127.0.0.1", 0, tls=TlsFiles(keyfile, certfile))
        listener.start()
        try:
            context = ssl.create_default_context(cafile=certfile)  # the client checks the certificate
            for _ in range(100):
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port, ssl=context)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            raw = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert raw.startswith(b"HTTP/1.1 200") and _dechunk(raw.partition(b"\r\n\r\n")[2]) == b"secure"
            assert listener.scheme == "https"
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)  # plain HTTP
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            plain = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert b"secure" not in plain
        finally:
            await listener.stop()

    asyncio.run(main())


def test_a_bad_certificate_fails_the_constructor_naming_the_setting(tmp_path):
    from router.http_listener import TlsFiles

    keyfile, _ = _self_signed(tmp_path)
    (tmp_path / "broken.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"router\.ssl_certfile=.*broken\.pem"):
        HttpListener(_app("x"), "127.0.0.1", 0, tls=TlsFiles(keyfile, str(tmp_path / "broken.pem")))


@pytest.mark.parametrize("access_log", [False, True])
def test_the_access_log_writes_a_line_per_request_only_when_asked(access_log, caplog):
    async def main():
        listener = HttpListener(_app("logged"), "127.0.0.1", 0, access_log=access_log)
        listener.start()
        await _wait_serving(listener)
        with caplog.at_level("INFO", logger="uvicorn.access"):
            caplog.clear()
            assert await _get(listener.port, "/logged-path") == (200, b"logged")
            await asyncio.sleep(0.05)
        await listener.stop()
        return [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]

    lines = asyncio.run(main())
    assert any("/logged-path" in line and "200" in line for line in lines) == access_log, lines
