"""Trace replay: request arrival times and lengths read from a recorded trace.

A trace is JSON Lines, one request per line (blank lines and lines starting with ``#`` are skipped).
Three sets of field names are accepted, per line, so a public trace can be replayed as downloaded:

- Mooncake (kvcache-ai/Mooncake traces): ``timestamp`` (milliseconds), ``input_length``, ``output_length``
- Azure LLM inference trace (2023/2024): ``TIMESTAMP`` (ISO datetime, or seconds), ``ContextTokens``,
  ``GeneratedTokens``
- pdserve (``write_trace``): ``arrival_s`` (seconds), ``num_prompt_tokens``, ``num_output_tokens``

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}
    {"TIMESTAMP": "2023-11-16 18:15:46.6805900", "ContextTokens": 374, "GeneratedTokens": 44}
    {"arrival_s": 0.25, "num_prompt_tokens": 120, "num_output_tokens": 64}

Other fields (Mooncake's ``hash_ids``, say) are ignored. A ``.csv`` file with a header row of the
same names is read too, since the Azure trace ships as CSV. Arrivals become seconds after the
earliest request, sorted; ``time_scale`` divides them (2.0 replays twice as fast) and
``max_requests`` keeps the earliest ones.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from common.errors import ConfigError


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int


def _seconds(value: object) -> float:
    return float(str(value))


def _milliseconds(value: object) -> float:
    return float(str(value)) / 1000.0


def _azure_seconds(value: object) -> float:
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    # The Azure trace writes 7 fractional digits ("2023-11-16 18:15:46.6805900") and Python 3.10's
    # fromisoformat takes at most 6, nor a trailing "Z".
    text = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("Z", "+00:00")
    stamp = datetime.fromisoformat(text)
    if stamp.tzinfo is None:  # read naive stamps as UTC so a DST change cannot shift the gaps
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


# (arrival field, its value in seconds, prompt-token field, output-token field)
_FORMATS: tuple[tuple[str, Callable[[object], float], str, str], ...] = (
    ("arrival_s", _seconds, "num_prompt_tokens", "num_output_tokens"),
    ("timestamp", _milliseconds, "input_length", "output_length"),
    ("TIMESTAMP", _azure_seconds, "ContextTokens", "GeneratedTokens"),
)
_KNOWN = "; ".join(f"{t}/{p}/{o}" for t, _, p, o in _FORMATS)


def _parse(row: dict, where: str) -> TraceRequest:
    for time_field, to_seconds, prompt_field, output_field in _FORMATS:
        if time_field in row:
            try:
                return TraceRequest(
                    to_seconds(row[time_field]), int(float(row[prompt_field])), int(float(row[output_field]))
                )
            except (KeyError, ValueError, TypeError) as e:
                raise ConfigError(f"{where}: bad {time_field!r} trace record ({e!r}); expected {_KNOWN}") from e
    raise ConfigError(f"{where}: no known timestamp field in {sorted(row)}; expected one of {_KNOWN}")


def _rows(path: Path) -> Iterator[tuple[dict, str]]:
    with path.open(newline="") as f:
        if path.suffix.lower() == ".csv":
            for number, row in enumerate(csv.DictReader(f), start=2):
                yield row, f"{path}:{number}"
            return
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number}: not a JSON object ({e.msg}); a trace is JSON Lines") from e
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield row, f"{path}:{number}"


def read_trace(path: str | Path, *, time_scale: float = 1.0, max_requests: int | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order, arrivals in seconds after the first (see module docstring)."""
    path = Path(path)
    if time_scale <= 0:
        raise ConfigError(f"time_scale must be > 0 (a speed-up factor), got {time_scale}")
    if not path.is_file():
        raise ConfigError(f"trace file {path} does not exist")
    requests = sorted((_parse(row, where) for row, where in _rows(path)), key=lambda r: r.arrival_s)
    if max_requests is not None:
        requests = requests[: max(0, max_requests)]
    if not requests:
        return []
    first = requests[0].arrival_s
    return [
        TraceRequest((r.arrival_s - first) / time_scale, r.num_prompt_tokens, r.num_output_tokens) for r in requests
    ]


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> Path:
    """Write ``requests`` in pdserve's own trace format, so a generated workload can be replayed elsewhere."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")
    return path
