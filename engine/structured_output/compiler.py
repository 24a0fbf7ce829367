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

from common.structured_outputs import StructuredOutput

DEFAULT_CACHE_SIZE = 128


@dataclass(slots=True)
class CompileStats:
    """Counts since start, and the compile times not yet taken (drained by the metrics' reader)."""

    num_hits: int = 0
    num_misses: int = 0
    num_failures: int = 0
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
            self.stats.compile_seconds.append(time.perf_counter() - started)
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:  # only this pool's worker thread gets here
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            # Our own cache above bounds what is kept; xgrammar's would keep a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
