"""Which transformers class loads a model's tokenizer, read from its files (no transformers here).

``AutoTokenizer.from_pretrained`` imports transformers' model-configuration machinery to pick a
class (~1.8 s of CPU in a fresh process, paid by every replica and the router at start). A
tokenizer saved as ``TokenizersBackend`` (or ``PreTrainedTokenizerFast``) with its
``tokenizer.json`` is described whole by that file and its config: the generic fast class loads it
the same, without the import. Any other class (one with behaviour of its own) goes through
``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def generic_fast_tokenizer(model_dir: str | Path) -> bool:
    """True when ``PreTrainedTokenizerFast.from_pretrained(model_dir)`` loads what AutoTokenizer would."""
    directory = Path(model_dir)
    if not (directory / "tokenizer.json").is_file():
        return False
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_CLASSES
