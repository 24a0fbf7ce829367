"""Open-loop streaming load client for any OpenAI-compatible server (pdserve, vLLM, SGLang, ...).

Each request of a workload is sent at its arrival time whether or not earlier ones have finished
(open loop, as DistServe and ``vllm bench serve`` measure), streamed, and timed as the client sees it:

    TTFT  send → first chunk that carries text
    ITL   the gaps between chunks that carry text
    E2E   send → end of the stream
    TPOT  (E2E − TTFT) / (output tokens − 1), vLLM's definition; None for a single token

The HTTP client is a small HTTP/1.1 one over asyncio streams (chunked or close-delimited bodies, one
connection per request), so timings see bytes as they arrive, with no client library's pooling or
buffering in between. Failures (HTTP status, error event, timeout, broken connection) become records
with an ``error`` and count as SLO misses.

Where a server's usage breaks TTFT down (pdserve's ``usage.ttft_breakdown``: queue, prefill, exposed KV
transfer, other), each record keeps it, and the summary says which part made the TTFT SLO misses
(every completed request's, without an SLO): each part's mean, and how many had it as their largest.

    python -m bench.load_client --base-url http://127.0.0.1:8000/v1 --model SmolLM2-135M-Instruct \\
        --workload chatbot --rate 2 --num-requests 50 --ttft-slo 1.0 --tpot-slo 0.2 --scale 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from bench.common import print_table, write_json
from bench.slo import SLO, RequestTiming, attainment
from bench.workloads import ARRIVALS, WorkloadRequest, build_workload
from common.errors import ConfigError

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
# The parts of pdserve's usage.ttft_breakdown (each "<part>_s"), in the order a tie is settled.
TTFT_PARTS = ("queue", "prefill", "kv_transfer_exposed", "other")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds, ``send_s`` from the start of the run."""

    index: int
    arrival_s: float  # when the workload scheduled it
    send_s: float  # when it went out (later than arrival_s only if max_in_flight held it back)
    num_prompt_tokens: int  # as the workload asked
    max_tokens: int
    ttft_s: float | None
    itl_s: tuple[float, ...]
    e2e_s: float | None
    num_output_tokens: int  # from the usage chunk, else the number of text chunks
    usage_prompt_tokens: int | None  # as the server counted them (chat templates add some)
    error: str | None = None
    usage_cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache
    # The server's breakdown of its own TTFT (usage.ttft_breakdown; None where it sends none). The
    # client's TTFT is longer by the network and the client's own time.
    ttft_queue_s: float | None = None
    ttft_prefill_s: float | None = None
    ttft_kv_transfer_exposed_s: float | None = None  # None where no KV moved (colocated)
    ttft_other_s: float | None = None

    @property
    def succeeded(self) -> bool:
        return self.error is None

    def ttft_parts(self) -> dict[str, float | None] | None:
        """{part: seconds} of the server's breakdown, None if it sent none (``other`` is always there)."""
        if self.ttft_other_s is None:
            return None
        return {part: getattr(self, f"ttft_{part}_s") for part in TTFT_PARTS}

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def timing(self) -> RequestTiming:
        return RequestTiming(self.ttft_s, self.tpot_s, self.e2e_s, self.num_output_tokens, self.succeeded)


def _hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens served from the prefix cache over prompt tokens, as the server's usage counts them."""
    counted = [r for r in records if r.usage_cached_tokens is not None and r.usage_prompt_tokens]
    total = sum(r.usage_prompt_tokens or 0 for r in counted)
    return sum(r.usage_cached_tokens or 0 for r in counted) / total if total else None


def _largest_part(parts: dict[str, float | None]) -> str:
    return max((part for part in TTFT_PARTS if parts[part] is not None), key=lambda part: parts[part] or 0.0)


def ttft_breakdown_summary(records: Sequence[RequestRecord], slo: SLO | None) -> dict:
    """Over the completed requests that missed the TTFT SLO (all completed ones without an SLO) and
    whose server broke their TTFT down: each part's mean (over those that have it; no KV moved, no
    exposed transfer) and ``ttft_miss_by``, how many had each part as their largest."""
    missed = [r for r in records if r.succeeded and (slo is None or r.ttft_s is None or r.ttft_s > slo.ttft_s)]
    parts = [p for r in missed if (p := r.ttft_parts()) is not None]
    out: dict = {
        "ttft_breakdown_over": "completed" if slo is None else "ttft_slo_misses",
        "ttft_breakdown_requests": len(parts),
    }
    for part in TTFT_PARTS:
        values = [value for p in parts if (value := p[part]) is not None]
        out[f"mean_ttft_{part}_s"] = float(np.mean(values)) if values else None
    largest = Counter(_largest_part(p) for p in parts)
    out["ttft_miss_by"] = {part: largest[part] for part in TTFT_PARTS}
    return out


def _percentiles(name: str, values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"{k}_{name}_s": None for k in ("mean", "p50", "p90", "p99")}
    p50, p90, p99 = (float(p) for p in np.percentile(values, [50, 90, 99]))
    return {f"mean_{name}_s": float(np.mean(values)), f"p50_{name}_s": p50, f"p90_{name}_s": p90, f"p99_{name}_s": p99}


@dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]
    duration_s: float  # start → last response
    base_url: str = ""
    model: str = ""
    endpoint: str = "completions"

    def timings(self) -> list[RequestTiming]:
        return [r.timing() for r in self.records]

    def summary(self, slo: SLO | None = None) -> dict:
        ok = [r for r in self.records if r.succeeded]
        arrivals = [r.arrival_s for r in self.records]
        span = max(arrivals) - min(arrivals) if arrivals else 0.0
        duration = max(self.duration_s, 1e-9)
        out: dict = {
            "num_requests": len(self.records),
            "completed": len(ok),
            "failed": len(self.records) - len(ok),
            "duration_s": self.duration_s,
            "offered_rate": (len(arrivals) - 1) / span if span > 0 else None,
            "max_send_lag_s": max((r.send_s - r.arrival_s for r in self.records), default=None),
            "request_throughput": len(ok) / duration,
            "output_throughput": sum(r.num_output_tokens for r in ok) / duration,
            "prefix_cache_hit_rate": _hit_rate(ok),
        }
        out |= _percentiles("ttft", [r.ttft_s for r in ok if r.ttft_s is not None])
        out |= _percentiles("tpot", [t for r in ok if (t := r.tpot_s) is not None])
        out |= _percentiles("itl", [gap for r in ok for gap in r.itl_s])
        out |= _percentiles("e2e", [r.e2e_s for r in ok if r.e2e_s is not None])
        if slo is not None:
            timings, inf = self.timings(), float("inf")
            out["slo"] = asdict(slo)
            out["slo_attainment"] = attainment(timings, slo)
            # Which phase misses: DistServe sizes the prefill pool by TTFT, the decode pool by TPOT.
            out["ttft_attainment"] = attainment(timings, SLO(slo.ttft_s, inf))
            out["tpot_attainment"] = attainment(timings, SLO(inf, slo.tpot_s))
        return out | ttft_breakdown_summary(self.records, slo)

    def to_json(self, slo: SLO | None = None) -> dict:
        """A JSON-serializable dict: the summary and every request's timings, for re-analysis."""
        requests = [asdict(r) | {"tpot_s": r.tpot_s} for r in self.records]
        meta = {"base_url": self.base_url, "model": self.model, "endpoint": self.endpoint}
        return meta | {"duration_s": self.duration_s, "summary": self.summary(slo), "requests": requests}

    @classmethod
    def from_json(cls, data: dict) -> LoadResult:
        names = {f.name for f in fields(RequestRecord)}
        records = tuple(
            RequestRecord(**({k: v for k, v in r.items() if k in names} | {"itl_s": tuple(r["itl_s"])}))
            for r in data["requests"]
        )
        return cls(records, data["duration_s"], data.get("base_url", ""), data.get("model", ""), data["endpoint"])


# ---------------------------------------------------------------- HTTP/1.1 + server-sent events
class _HttpError(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ConnectionError(f"bad HTTP status line {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                return  # trailers, if any, are left unread: the connection is closed next
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def _sse_data(body: AsyncIterator[bytes]) -> AsyncIterator[str]:
    buffer = b""
    async for chunk in body:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    path: str
    tls: bool

    @classmethod
    def parse(cls, base_url: str, endpoint: str) -> _Target:
        if endpoint not in ENDPOINTS:
            raise ConfigError(f"unknown endpoint {endpoint!r}; known: {', '.join(ENDPOINTS)}")
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"base URL {base_url!r} must look like http://HOST:PORT/v1")
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url.hostname, port, url.path.rstrip("/") + ENDPOINTS[endpoint], url.scheme == "https")


async def _stream(target: _Target, body: bytes, api_key: str | None) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of one streaming POST; raises _HttpError on a non-200 status."""
    context = ssl.create_default_context() if target.tls else None
    reader, writer = await asyncio.open_connection(target.host, target.port, ssl=context)
    try:
        head = (
            f"POST {target.path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n"
            + (f"Authorization: Bearer {api_key}\r\n" if api_key else "")
            + f"Content-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200:
            text = b"".join([chunk async for chunk in _read_body(reader, headers)]).decode(errors="replace")
            raise _HttpError(f"HTTP {status}: {text.strip()[:500]}")
        async for data in _sse_data(_read_body(reader, headers)):
            yield data
    finally:
        writer.close()


# ---------------------------------------------------------------- the open loop
@dataclass(frozen=True)
class _Run:
    """What every request of one run shares."""

    target: _Target
    chat: bool
    timeout_s: float
    api_key: str | None
    start: float  # perf_counter at the start of the run


@dataclass(slots=True)
class _Clock:
    """Text-chunk times of one stream, as they arrive."""

    sent: float
    ttft: float | None = None
    last: float = 0.0
    num_chunks: int = 0

    def text_chunk(self, gaps: list[float]) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.sent
        else:
            gaps.append(now - self.last)
        self.last, self.num_chunks = now, self.num_chunks + 1


async def _consume(run: _Run, body: bytes, clock: _Clock, gaps: list[float], usage: dict) -> None:
    async with aclosing(_stream(run.target, body, run.api_key)) as stream:  # closes the connection on [DONE]
        async for data in stream:
            if data == "[DONE]":
                return
            event = json.loads(data)
            if event.get("error"):
                raise _HttpError(f"error event: {json.dumps(event['error'])[:500]}")
            usage.update(event.get("usage") or {})
            choice = (event.get("choices") or [{}])[0]
            if (choice.get("delta") or {}).get("content") if run.chat else choice.get("text"):
                clock.text_chunk(gaps)


def _seconds(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _ttft_breakdown(usage: dict) -> dict[str, float | None]:
    """The record's ttft_*_s fields from a usage object (all None where the server sends no breakdown)."""
    breakdown = usage.get("ttft_breakdown")
    if not isinstance(breakdown, dict):
        breakdown = {}
    return {f"ttft_{part}_s": _seconds(breakdown.get(f"{part}_s")) for part in TTFT_PARTS}


async def _run_one(run: _Run, index: int, request: WorkloadRequest, body: bytes) -> RequestRecord:
    clock, error = _Clock(time.perf_counter()), None
    gaps: list[float] = []
    usage: dict = {}
    try:
        await asyncio.wait_for(_consume(run, body, clock, gaps, usage), run.timeout_s)
        if clock.ttft is None:
            error = "the stream ended without any text"
    except asyncio.TimeoutError:
        error = f"timed out after {run.timeout_s} s"
    except Exception as e:  # any failure ends this request only; the run goes on
        error = str(e) if isinstance(e, _HttpError) else f"{type(e).__name__}: {e}"
    return RequestRecord(
        index=index,
        arrival_s=request.arrival_s,
        send_s=clock.sent - run.start,
        num_prompt_tokens=request.num_prompt_tokens,
        max_tokens=request.num_output_tokens,
        ttft_s=clock.ttft,
        itl_s=tuple(gaps),
        e2e_s=time.perf_counter() - clock.sent if error is None else None,
        num_output_tokens=int(usage.get("completion_tokens") or clock.num_chunks),
        usage_prompt_tokens=usage.get("prompt_tokens"),
        error=error,
        usage_cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        **_ttft_breakdown(usage),
    )


def _body(model: str, request: WorkloadRequest, chat: bool, ignore_eos: bool) -> bytes:
    payload: dict = {"model": model}
    payload |= {"messages": [{"role": "user", "content": request.prompt}]} if chat else {"prompt": request.prompt}
    payload |= {
        "max_tokens": request.num_output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,  # a vLLM/pdserve extension; servers without it ignore unknown fields
    }
    return json.dumps(payload).encode()


async def run_load(
    base_url: str,
    model: str,
    workload: Sequence[WorkloadRequest],
    *,
    endpoint: str = "completions",
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    progress: bool = True,
    max_in_flight: int = 1024,
    api_key: str | None = None,
) -> LoadResult:
    """Send every request at its ``arrival_s`` (open loop) and time its stream; see the module docstring.

    Only ``max_in_flight`` requests may be open at once, to keep the client bounded; a request held
    back by it goes out late, which its ``send_s`` (and the summary's ``max_send_lag_s``) shows.
    """
    target = _Target.parse(base_url, endpoint)
    chat = endpoint == "chat"
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_s)
    bodies = {i: _body(model, workload[i], chat, ignore_eos) for i in order}
    slots = asyncio.Semaphore(max_in_flight)
    bar = tqdm(total=len(workload), unit="req", disable=not progress, dynamic_ncols=True)
    run = _Run(target, chat, timeout_s, api_key, start=time.perf_counter())

    async def one(index: int) -> RequestRecord:
        try:
            record = await _run_one(run, index, workload[index], bodies[index])
        finally:
            slots.release()
        bar.update(1)
        return record

    tasks = []
    for index in order:
        delay = run.start + workload[index].arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await slots.acquire()
        tasks.append(asyncio.create_task(one(index)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - run.start
    bar.close()
    return LoadResult(tuple(sorted(records, key=lambda r: r.index)), duration, base_url, model, endpoint)


def print_summary(result: LoadResult, slo: SLO | None = None) -> None:
    s = result.summary(slo)
    stats = ["mean", "p50", "p90", "p99"]
    rows = []
    for metric in ("ttft", "tpot", "itl", "e2e"):
        row: dict = {"metric": f"{metric.upper()} (ms)"}
        for stat in stats:
            value = s[f"{stat}_{metric}_s"]
            row[stat] = None if value is None else value * 1000
        rows.append(row)
    print_table(f"latency ({result.endpoint}, {result.model})", rows, ["metric", *stats])
    names = ["completed", "failed", "duration_s", "offered_rate", "max_send_lag_s", "request_throughput"]
    names += ["output_throughput", "slo_attainment", "ttft_attainment", "tpot_attainment"]
    print_table("load", [{"name": n, "value": s[n]} for n in names if n in s], ["name", "value"])
    if any(r.ttft_parts() is not None for r in result.records):  # the server breaks its TTFT down
        over = "requests that missed the TTFT SLO" if slo is not None else "completed requests"
        rows = [
            {
                "part": part,
                "mean (ms)": None if (mean := s[f"mean_ttft_{part}_s"]) is None else mean * 1000,
                "largest in": s["ttft_miss_by"][part],
            }
            for part in TTFT_PARTS
        ]
        title = f"server TTFT breakdown, over {s['ttft_breakdown_requests']} {over}"
        print_table(title, rows, ["part", "mean (ms)", "largest in"])


# ---------------------------------------------------------------- CLI
def _load_tokenizer(path: str | None, model: str):
    from transformers import AutoTokenizer

    from engine.model_loader import DEFAULT_MODEL_NAME, resolve_model_dir

    if path is None and model == DEFAULT_MODEL_NAME:
        path = str(resolve_model_dir(None))
    try:
        return AutoTokenizer.from_pretrained(path or model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer for {model!r} ({e}); pass --tokenizer PATH") from e


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's, for pdserve's default)")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    parser.add_argument("--workload", default="chatbot", help="chatbot, code, summarization, fixed:IN,OUT, ...")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (inf: all at once)")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--scale", type=float, default=1.0, help="length scale (0.1: ten times shorter)")
    parser.add_argument("--ttft-slo", type=float, help="seconds")
    parser.add_argument("--tpot-slo", type=float, help="seconds")
    parser.add_argument("--e2e-slo", type=float, help="seconds (optional)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--max-in-flight", type=int, default=1024)
    parser.add_argument("--api-key")
    parser.add_argument("--no-ignore-eos", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, help="JSON output path (default: bench/results/load_client.json)")
    args = parser.parse_args(argv)
    if (args.ttft_slo is None) != (args.tpot_slo is None):
        parser.error("--ttft-slo and --tpot-slo go together")
    slo = None if args.ttft_slo is None else SLO(args.ttft_slo, args.tpot_slo, args.e2e_slo)

    tokenizer = _load_tokenizer(args.tokenizer, args.model)
    workload = build_workload(
        args.workload,
        args.rate,
        args.num_requests,
        arrival=args.arrival,
        burstiness=args.burstiness,
        seed=args.seed,
        max_model_len=args.max_model_len,
        scale=args.scale,
        tokenizer=tokenizer,
    )
    load = run_load(
        args.base_url,
        args.model,
        workload,
        endpoint=args.endpoint,
        timeout_s=args.timeout,
        ignore_eos=not args.no_ignore_eos,
        progress=not args.no_progress,
        max_in_flight=args.max_in_flight,
        api_key=args.api_key,
    )
    result = asyncio.run(load)
    print_summary(result, slo)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"}
    payload = {"config": config, **result.to_json(slo)}
    if args.out is None:
        write_json("load_client", payload)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
