"""Constrained decoding: each request's constraint compiled once (off the step path), its token
mask applied before sampling, its matcher advanced by every token it keeps.

    add_request ─▶ GrammarCompilerPool.submit (a thread; LRU cache by the constraint's text)
                         │  ready
                         ▼
    schedule (a request whose grammar is not ready sits out; nothing allocated for it)
        ─▶ forward ─▶ fill_bitmask (the host, while the device computes) ─▶ sampler masks logits
        ─▶ token kept ─▶ advance (a token the matcher refuses: a dead end, the request stops)
"""

from engine.structured_output.bitmask import apply_token_bitmask
from engine.structured_output.compiler import CompileStats, GrammarCompilerPool
from engine.structured_output.manager import ConstraintEnd, StructuredOutputManager, TokenMask

__all__ = [
    "CompileStats",
    "ConstraintEnd",
    "GrammarCompilerPool",
    "StructuredOutputManager",
    "TokenMask",
    "apply_token_bitmask",
]
