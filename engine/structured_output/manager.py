"""Each constrained request's matcher: whether its grammar is ready, its token mask, its advance.

A matcher follows the request's output tokens, not the engine's calls: it accepts whatever the
request's ``output_token_ids`` hold beyond what it has seen. So a decode replica resumes from the
first token prefill sampled (it is the first output token when the KV lands), a preempted request
keeps its place, and no path needs to feed the matcher by hand.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import torch

from common.structured_outputs import StructuredOutput
from engine.request import PLACEHOLDER_TOKEN, Request
from engine.structured_output.compiler import GrammarCompilerPool


@dataclass(slots=True)
class TokenMask:
    """One step's masks: ``bitmask[i]`` (xgrammar's int32 words, on the host) is for sampler row
    ``rows[i]``."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass(frozen=True, slots=True)
class ConstraintEnd:
    """Why a constraint ends its request. ``token_refused``: the last token is outside it (every
    token was masked), so it is taken back."""

    reason: str
    token_refused: bool


@dataclass(slots=True)
class _RequestGrammar:
    future: concurrent.futures.Future
    constraint: StructuredOutput
    stop_token_ids: list[int]
    token_filter: torch.Tensor | None  # mask words ANDed into every mask (GrammarCompilerPool.json_filter)
    matcher: Any = None
    num_accepted: int = 0  # output tokens the matcher has taken


class StructuredOutputManager:
    """Engine thread only (the compile pool's thread touches nothing here but futures)."""

    def __init__(self, compilers: GrammarCompilerPool) -> None:
        self.compilers = compilers
        self._grammars: dict[str, _RequestGrammar] = {}
        self._pending: set[str] = set()  # grammar still compiling
        self._bitmask: torch.Tensor | None = None  # reused while the batch fits
        self.num_constrained_tokens = 0  # tokens sampled under a mask, since start
        self.num_dead_ends = 0

    def report(self) -> dict[str, int | float]:
        """The counters of a replica's report (common.serving.ReplicaReport)."""
        stats = self.compilers.stats
        return {
            "num_grammar_compiles": stats.num_misses,
            "grammar_compile_seconds": stats.compile_seconds_total,
            "num_grammar_cache_hits": stats.num_hits,
            "num_constrained_tokens": self.num_constrained_tokens,
            "num_constraint_dead_ends": self.num_dead_ends,
        }

    def add(self, request: Request) -> None:
        params = request.sampling_params
        if params.structured_output is None:
            return
        stops = set(params.stop_token_ids) if params.ignore_eos else {*request.eos_token_ids, *params.stop_token_ids}
        future = self.compilers.submit(params.structured_output)
        self._grammars[request.request_id] = _RequestGrammar(future, params.structured_output, sorted(stops), None)
        if not future.done():
            self._pending.add(request.request_id)

    def remove(self, request_id: str) -> None:
        if self._grammars.pop(request_id, None) is not None:
            self._pending.discard(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    def pending_ids(self) -> set[str]:
        """Requests whose grammar is still compiling (they sit out the step)."""
        if self._pending:
            self._pending = {rid for rid in self._pending if not self._grammars[rid].future.done()}
        return self._pending

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until one pending compile ends or ``timeout_s``: a step with nothing else to run
        waits here instead of spinning."""
        futures = [self._grammars[rid].future for rid in self._pending]
        if futures:
            concurrent.futures.wait(futures, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of the requests whose compile failed; forgotten here."""
        failed = []
        for request_id, grammar in self._grammars.items():
            if grammar.future.done() and grammar.future.exception() is not None:
                failed.append((request_id, f"the constraint did not compile: {grammar.future.exception()}"))
        for request_id, _ in failed:
            self.remove(request_id)
        return failed

    def fill_bitmask(self, requests: list[Request], vocab_size: int) -> TokenMask | None:
        """The masks of the constrained rows among ``requests`` (the sampler's rows, in order)."""
        rows = [i for i, request in enumerate(requests) if request.request_id in self._grammars]
        if not rows:
            return None
        import xgrammar as xgr  # imported by the compile that made these grammars ready

        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(max(len(rows), 32), vocab_size)
        bitmask = self._bitmask[: len(rows)]
        for slot, i in enumerate(rows):
            grammar = self._synced(requests[i])
            if grammar.matcher.is_terminated():
                bitmask[slot].zero_()  # nothing allowed: advance() ends the request on its token
            else:
                grammar.matcher.fill_next_token_bitmask(bitmask, slot)
                if grammar.token_filter is not None:
                    bitmask[slot] &= grammar.token_filter
        self.num_constrained_tokens += len(rows)
        return TokenMask(bitmask, rows)

    def advance(self, request: Request) -> ConstraintEnd | None:
        """Take the request's new tokens. A reason when the constraint ends it: a token outside
        it (every token was masked: a dead end), or a grammar complete while the request goes on
        (it cannot end by EOS: ignore_eos)."""
        grammar = self._grammars.get(request.request_id)
        if grammar is None:
            return None
        tokens = request.output_token_ids
        end = len(tokens) - (1 if request.has_placeholder else 0)
        matcher = self._matcher(grammar)
        for token_id in tokens[grammar.num_accepted : end]:
            if matcher.is_terminated():
                return ConstraintEnd("the constraint is complete", token_refused=False)
            if token_id == PLACEHOLDER_TOKEN or not matcher.accept_token(token_id):
                self.num_dead_ends += 1
                return ConstraintEnd(f"the constraint allows no token here (dead end at {token_id})", True)
            grammar.num_accepted += 1
        if matcher.is_terminated() and not request.is_finished:
            return ConstraintEnd("the constraint is complete", token_refused=False)
        return None

    def _synced(self, request: Request) -> _RequestGrammar:
        # The engine ends a request at the token advance() refuses, before it is scheduled again:
        # here it only catches up (the first token of a decode replica's request, say).
        self.advance(request)
        return self._grammars[request.request_id]

    def _matcher(self, grammar: _RequestGrammar) -> Any:
        if grammar.matcher is None:
            import xgrammar as xgr

            assert grammar.future.done(), "a request is scheduled before its grammar compiled"
            grammar.token_filter = self.compilers.json_filter(grammar.constraint)
            grammar.matcher = xgr.GrammarMatcher(
                grammar.future.result(),
                override_stop_tokens=grammar.stop_token_ids or None,
                terminate_without_stop_token=not grammar.stop_token_ids,
            )
        return grammar.matcher
