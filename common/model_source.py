"""What a ``model`` string names, and a chat template given as a file or inline, read without
torch or transformers (the cluster's config validates both before anything loads).

A ``model`` is the default model (None), a local path (a Hugging Face directory or a ``.gguf``
file), or a Hugging Face Hub id (``org/name``), as ``vllm serve`` takes it.
"""

from __future__ import annotations

import re
from pathlib import Path

from common.errors import ConfigError

# The Hub's own rule for repo ids (huggingface_hub.utils.validate_repo_id): one namespace, a name.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}$")
# Characters a Jinja template has and a file path has not (vLLM's own test for an inline template).
_JINJA_CHARS = "{}\n"


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not a path on this machine: a Hub id."""
    if Path(model).expanduser().exists() or model.startswith(("/", ".", "~")):
        return False
    return _HUB_ID.match(model) is not None and ".." not in model and not model.endswith(".gguf")


def load_chat_template(value: str) -> str:
    """``value`` as vLLM's ``--chat-template`` reads it: the text of the file it names, or the
    template itself when it holds Jinja's characters. ConfigError for a path that cannot be read."""
    if any(c in value for c in _JINJA_CHARS):
        return value
    path = Path(value).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"chat_template={value!r} is neither a readable file ({exc.strerror or exc}) nor an inline "
            "Jinja template (one has '{' or a newline)"
        ) from None
    if not text.strip():
        raise ConfigError(f"chat_template file {path} is empty")
    return text
