"""Shared bits of the benchmarks: prompts of exact lengths, result tables and JSON output."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

_TEXT = (
    "Lighthouses once burned wood and coal on open platforms; later towers carried oil lamps behind "
    "polished reflectors, and the Fresnel lens bent their light into beams seen twenty miles away. "
    "Keepers climbed the stairs each evening, trimmed wicks, wound the clockwork that turned the lens, "
    "and wrote the weather into their logs. Ships read each light's pattern of flashes to fix their "
    "position along the coast, and every light had its own character. "
)


def exact_length_prompts(tokenizer, num_prompts: int, length: int) -> list[list[int]]:
    """Real text, token ids cut to exactly ``length``, each prompt starting at a different offset."""
    ids = tokenizer.encode(_TEXT * (2 + (length + num_prompts * 7) // 60))
    assert len(ids) >= length + num_prompts * 7, "text too short for the requested prompts"
    return [ids[i * 7 : i * 7 + length] for i in range(num_prompts)]


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(f"\n{title}")
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "machine": platform.machine(),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return path
