"""Peers in real child processes for the kill drills: a Python script that talks over stdout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A decode shard in its own process, serving over backend argv[1] with a lease of argv[2] seconds;
# prints its ticket (msgpack, hex), then waits to be killed.
RECEIVER_SCRIPT = """
import sys, time, msgpack
from kv_transfer import KVReceiver, make_ticket
from kv_transfer.transport import get_transport
from tests.kv_transfer.harness import make_side

backend, lease_s = sys.argv[1], float(sys.argv[2])
dst, _ = make_side(1, fill=False)
receiver = KVReceiver(dst.caches[0], dst.layouts[0], backend)
transport = get_transport(backend)  # held: a dropped transport's servers stop
endpoint = transport.serve(receiver)
ticket = make_ticket("req-1", backend, [endpoint], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s)
receiver.expect(ticket)
print(msgpack.packb(ticket.to_dict(), use_bin_type=True).hex(), flush=True)
time.sleep(600)
"""


# A sender in another process: "ready" once its imports are done, then a ticket read from stdin,
# two layers pushed under it and acknowledged, "sent"; what follows is the test's own.
SENDS_TWO_LAYERS = """
import sys, time, msgpack
from kv_transfer import KVSender, KVTicket
from tests.kv_transfer.harness import make_side
IMPORT

print("ready", flush=True)
ticket = KVTicket.from_dict(msgpack.unpackb(bytes.fromhex(sys.stdin.readline()), raw=False))
src, _ = make_side(1, fill=True)
sender = KVSender(src.layouts[0], "m", TRANSPORT)
sender.start(ticket, [7, 8, 9, 10])
for layer in (0, 1):
    sender.send_layer("req-1", layer, src.caches[0][layer])
while sender.poll("req-1").layers_sent < 2:
    time.sleep(0.01)
print("sent", flush=True)
"""


def sender_script(imports: str, transport: str, rest: str) -> str:
    """SENDS_TWO_LAYERS over ``transport`` (an expression over ``imports``), then ``rest``."""
    return SENDS_TWO_LAYERS.replace("IMPORT", imports).replace("TRANSPORT", transport) + rest


def spawn_python(script: str, *args: str) -> subprocess.Popen:
    """``python -c script args`` with this repository importable, stdin and stdout piped as text."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """One line of the child's stdout, or fail (never hang) if it does not come."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box or not box[0]:
        proc.kill()
        pytest.fail(f"child process gave no output within {timeout_s}s (exit code {proc.poll()})")
    return box[0].strip()
