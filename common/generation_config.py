"""The model's own sampling defaults, from its ``generation_config.json``: what a request that
leaves a field out gets (vLLM's ``--generation-config auto``), never over a value it sent."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json's key -> the request field it is the default of (vLLM reads these).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The request fields the model's generation_config.json sets ({} without one). A value of the
    wrong type is left out, with a warning: the model's file must not refuse every request."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("%s cannot be read (%s): no sampling defaults from it", path, exc)
        return {}
    defaults: dict[str, Any] = {}
    for key, field in _SAMPLING_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            logger.warning("%s: %s=%r is not a number; ignored", path, key, value)
            continue
        defaults[field] = value
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s", path, defaults)
    return defaults
