"""The running requests' counters as numpy columns, one row per request in the scheduler's running
order, so that a step in which every running request decodes is planned and applied with a few
array operations instead of Python per request.

The ``Request`` objects stay the truth: the scheduler writes their counters as before, and the
table is a copy it keeps in step with them. Whatever changes requests one at a time (admission, a
prompt chunk, preemption, an abort) marks the table stale, and the next all-decode step reads it
again from the requests; the rows of finished requests are dropped (``keep``). ``version`` changes
whenever rows may no longer be where a step in flight recorded them (preemption, an abort, a finish
while the table is stale), so those rows are only used while it is unchanged.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from micro_vllm.core.kv_cache_manager import KVCacheManager
    from micro_vllm.core.request import Request


_COLUMNS = ("num_computed_tokens", "num_tokens", "num_output_placeholders", "max_num_tokens", "num_prompt_tokens",
            "num_held_tokens", "num_hashed_blocks", "has_grammar")


_MAX_TOKEN_ID = np.iinfo(np.int64).max
_ALL_ROWS = slice(None)


class RunningTable:
    def __init__(self) -> None:
        self.stale = True
        self.version = 0
        # The requests' ids in row order: a new tuple whenever the rows change, so that what is built
        # from them can be kept while it is the same one.
        self.req_ids: tuple[str, ...] = ()
        empty = np.zeros(0, np.int64)
        self.num_computed_tokens = self.num_tokens = self.num_output_placeholders = empty
        self.max_num_tokens = self.num_prompt_tokens = empty
        self.num_held_tokens = empty  # the tokens the request's KV blocks hold
        self.num_hashed_blocks = empty  # at most the leading blocks already hashed
        self.has_grammar = np.zeros(0, bool)
        # Sorted: every token that ends some running request (its EOS unless ignore_eos, its
        # stop_token_ids).
        self.stop_token_ids = np.zeros(0, np.int64)

    def invalidate(self, reordered: bool) -> None:
        """The requests changed one at a time; ``reordered``: a request left the running list."""
        self.stale = True
        if reordered:
            self.version += 1

    def refresh(self, running: list[Request], kv: KVCacheManager) -> None:
        """Read every running request's counters again, if anything changed them one at a time."""
        if not self.stale:
            return
        columns = np.array(
            [(r.num_computed_tokens, r.num_tokens, r.num_output_placeholders, r.max_num_tokens,
              r.num_prompt_tokens, kv.num_held_tokens(r.request_id), kv.num_hashed_blocks(r.request_id),
              r.grammar is not None) for r in running],
            np.int64,
        ).reshape(len(running), len(_COLUMNS))
        for name, column in zip(_COLUMNS, columns.T):
            setattr(self, name, column.astype(bool) if name == "has_grammar" else column.copy())
        self.req_ids = tuple(r.request_id for r in running)
        stop_ids = set()
        for request in running:
            params = request.sampling_params
            stop_ids.update(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids.update(request.eos_token_ids)
        # An id past int64 is never sampled.
        self.stop_token_ids = np.array(sorted(t for t in stop_ids if t <= _MAX_TOKEN_ID), np.int64)
        self.stale = False

    def keep(self, kept: np.ndarray) -> np.ndarray:
        """Drop the rows of requests that left the running list (``kept``: a mask over the rows, in
        order); return where each old row is now (-1: gone). The stop tokens may stay a superset."""
        for name in _COLUMNS:
            setattr(self, name, getattr(self, name)[kept])
        self.req_ids = tuple(itertools.compress(self.req_ids, kept))
        new_rows = np.cumsum(kept) - 1
        new_rows[~kept] = -1
        return new_rows

    def are_all(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` (ascending and distinct, as a step plans them) are every row of the table:
        then there are as many."""
        return len(rows) == len(self.req_ids)

    def index(self, rows: np.ndarray) -> np.ndarray | slice:
        """``rows`` (ascending and distinct) as an index of the columns: when they are every row, a
        slice, whose reads are views and whose in-place updates need no gather and scatter (most
        decode steps plan every running request)."""
        return _ALL_ROWS if self.are_all(rows) else rows

    def may_stop_at(self, token_ids: np.ndarray) -> np.ndarray:
        """Whether each of ``token_ids`` ends some running request."""
        stop_token_ids = self.stop_token_ids
        if not len(stop_token_ids):
            return np.zeros(len(token_ids), bool)
        found = np.minimum(np.searchsorted(stop_token_ids, token_ids), len(stop_token_ids) - 1)
        return stop_token_ids[found] == token_ids

    def update_kv_rows(self, rows: list[int], requests: list[Request], kv: KVCacheManager) -> None:
        """Read the KV counters of ``rows`` (holding ``requests``) again after they got blocks or hashes."""
        for row, request in zip(rows, requests):
            self.num_held_tokens[row] = kv.num_held_tokens(request.request_id)
            self.num_hashed_blocks[row] = kv.num_hashed_blocks(request.request_id)
