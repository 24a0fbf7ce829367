"""Compile constraints for one tokenizer on a worker thread, with a bounded cache.

The engine's thread only submits and polls: a compile (~10 ms for a schema on SmolLM2's 49K
vocabulary, seconds for a large grammar) never holds a step. Requests with the same constraint
share one compile, in flight or done (the cache holds futures). The first compile also imports
xgrammar and builds the tokenizer's vocabulary table (~2 s once per replica).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from common.structured_outputs import ConstraintKind, StructuredOutput

DEFAULT_CACHE_SIZE = 128
_KEPT_TIMES = 1024  # the latest compile times kept for a reader (benchmarks); older ones are dropped


@dataclass(slots=True)
class CompileStats:
    """Counts since start, and the compile times not yet taken (drained by the metrics' reader)."""

    num_hits: int = 0
    num_misses: int = 0
    num_failures: int = 0
    compile_seconds_total: float = 0.0  # of every compile that ended
    compile_seconds: list[float] = field(default_factory=list)

    def take_compile_seconds(self) -> list[float]:
        taken, self.compile_seconds = self.compile_seconds, []
        return taken


class GrammarCompilerPool:
    """``submit`` returns a future of xgrammar's CompiledGrammar (or of the constraint's error)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 1):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is touched by the engine's thread and the worker's
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._compiler: Any = None
        # JSON constraints' token filters (see json_filter), made with the compiler.
        self._json_filters: dict[bool, torch.Tensor] = {}
        self.stats = CompileStats()

    def submit(self, constraint: StructuredOutput) -> concurrent.futures.Future:
        key = constraint.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                self.stats.num_hits += 1
                return future
            self.stats.num_misses += 1
            future = self._executor.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, constraint: StructuredOutput) -> Any:
        started = time.perf_counter()
        try:
            compiled = self._get_compiler().compile_grammar(constraint.grammar())
        except BaseException:
            with self._lock:
                self.stats.num_failures += 1
            raise
        with self._lock:
            seconds = time.perf_counter() - started
            self.stats.compile_seconds.append(seconds)
            self.stats.compile_seconds_total += seconds
            del self.stats.compile_seconds[:-_KEPT_TIMES]
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:  # only this pool's worker thread gets here
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            self._json_filters = _json_filters(info.decoded_vocab, self._vocab_size)
            # Our own cache above bounds what is kept; xgrammar's would keep a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def json_filter(self, constraint: StructuredOutput) -> torch.Tensor | None:
        """The tokens a JSON constraint's output may hold whatever its grammar allows, as mask words
        to AND into its masks (None: no filter). xgrammar 0.2.9 lets a string with a maxLength
        hold raw control characters (its character class there is ``[^"\\\r\n]``, where an
        unbounded string's is ``[^\0-\x1f"\\\r\n]``), which no JSON parser reads: a random-weight
        model wrote a NUL there. Compact JSON has no control character anywhere; JSON with free
        whitespace may have tab, newline and carriage return between its tokens. Ready once any
        grammar of this pool is."""
        if constraint.kind not in (ConstraintKind.JSON, ConstraintKind.JSON_OBJECT):
            return None
        return self._json_filters.get(constraint.any_whitespace)

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _json_filters(decoded_vocab: list[bytes], vocab_size: int) -> dict[bool, torch.Tensor]:
    """{any_whitespace: mask words allowing every token without a control character (tab, newline
    and carriage return allowed when any_whitespace)}."""
    whitespace = {0x09, 0x0A, 0x0D}
    filters = {}
    for any_whitespace in (False, True):
        allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
        for token_id, raw in enumerate(decoded_vocab[:vocab_size]):
            if any(byte < 0x20 and not (any_whitespace and byte in whitespace) for byte in raw):
                allowed[token_id] = False
        filters[any_whitespace] = pack_bits(allowed)
    return filters


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A bool vector (a multiple of 32 long) as xgrammar's int32 mask words: bit j of word w is token 32w + j."""
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
