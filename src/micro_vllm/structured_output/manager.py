"""Structured output with xgrammar: one compiler per engine, one matcher per request, one bitmask per step.

Each step, before sampling, the grammar of every constrained row says which tokens may come next
(``StructuredOutputManager.grammar_bitmask``, filled on the host) and the other tokens' logits become
``-inf`` on the logits' device (``apply_grammar_bitmask``); after sampling, each grammar accepts its
row's token (``StructuredOutputGrammar.accept_tokens``).

A matcher's state is the tokens it has accepted, and only sampled tokens are fed to it. A preempted
request keeps its output tokens and is recomputed by feeding them to the model again, not to the
matcher, so its grammar goes on from where it was and needs no rollback.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from micro_vllm.structured_output.params import StructuredOutputsParams
from micro_vllm.validation import check_int

# Compiled grammars are cached by their text; a long-running engine sees unboundedly many schemas, so
# the cache evicts past this size.
_COMPILER_CACHE_BYTES = 512 * 1024 * 1024

# Threads one compile, or one step's bitmask, may use: half the CPUs, leaving the rest to the step
# loop (and, served, to the HTTP server), which a long compile would otherwise starve: with
# xgrammar's default of 8 on a 2-core machine, another client's stream paused for 1.5 s at a time
# while a large schema compiled.
_XGRAMMAR_THREADS = max(1, (os.cpu_count() or 2) // 2)

# A bitmask row of all ones (every int32 word -1) lets every token through.
_ALL_TOKENS = -1


class StructuredOutputGrammar:
    """One request's grammar matcher: which tokens may come next, and the tokens sampled so far."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, tokens: Iterable[int]) -> bool:
        """Advance over the sampled ``tokens``; False if the grammar forbids one (the mask was not
        applied). Tokens after the stop token are ignored: with async scheduling a finished request
        can still be sampled once more, and that token is dropped."""
        for token in tokens:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(token):
                return False
        return True

    def is_terminated(self) -> bool:
        """The output is complete and a stop token was accepted: the request must stop (also under
        ``ignore_eos``: past here the grammar constrains nothing)."""
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles requests' grammars for one tokenizer and model vocabulary, and builds each step's
    bitmask for up to ``max_num_seqs`` rows.

    ``vocab_size`` is the model's (the width of its logits), which is often padded past the
    tokenizer's: ids without a token are never allowed. ``stop_token_ids`` are the ids that end a
    request (the engine's EOS ids); a grammar allows only them once its output is complete. None
    takes the tokenizer's.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_num_seqs: int,
        stop_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.vocab_size = check_int("vocab_size", vocab_size, 1)
        check_int("max_num_seqs", max_num_seqs, 1)
        stop_ids = None if stop_token_ids is None else sorted(stop_token_ids)
        if stop_ids == []:
            raise ValueError("stop_token_ids=[] is not allowed: a grammar's output ends only at one of them; give at "
                             "least one id, or None for the tokenizer's")
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=_XGRAMMAR_THREADS,
                                            cache_limit_bytes=_COMPILER_CACHE_BYTES)
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        # Fills the rows of all live grammars in one call, on threads of its own: a step under a
        # grammar waits for its bitmask, and one Python call per row made that wait a large part of it.
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_XGRAMMAR_THREADS)

    def grammar_init(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for a request (compiled once per distinct constraint, then cached). The
        params were checked when built, so this compiles."""
        kind = params.kind
        if kind == "json":
            compiled = self.compiler.compile_json_schema(params.schema_text())
        elif kind == "json_object":
            compiled = self.compiler.compile_json_schema('{"type": "object"}')
        elif kind == "regex":
            compiled = self.compiler.compile_regex(params.regex)
        elif kind == "choice":
            compiled = self.compiler.compile_grammar(params.choice_grammar())
        else:
            compiled = self.compiler.compile_grammar(params.grammar)
        return StructuredOutputGrammar(xgr.GrammarMatcher(compiled))

    def grammar_bitmask(self, grammars: Sequence[StructuredOutputGrammar | None]) -> torch.Tensor | None:
        """The step's bitmask: row i for ``grammars[i]``, all ones where it is None (an unconstrained
        request) or terminated. None when no row is constrained, so the step skips masking.

        The tensor is an int32 CPU view of a buffer reused by the next call.
        """
        if all(grammar is None for grammar in grammars):
            return None
        if len(grammars) > self._bitmask.shape[0]:
            raise ValueError(f"{len(grammars)} rows is more than max_num_seqs={self._bitmask.shape[0]}")
        bitmask = self._bitmask[: len(grammars)]
        rows, matchers = [], []
        for index, grammar in enumerate(grammars):
            if grammar is None or grammar.is_terminated():
                bitmask[index].fill_(_ALL_TOKENS)
            else:
                rows.append(index)
                matchers.append(grammar.matcher)
        if matchers:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to ``-inf``, in place on the logits' device, every logit whose bit in ``bitmask`` is 0.

    Row i of ``bitmask`` masks row i of ``logits``; it covers the whole logits width (the model's
    vocabulary, padding included).
    """
    expected = (logits.shape[0], (logits.shape[1] + 31) // 32)
    if tuple(bitmask.shape) != expected:
        raise ValueError(
            f"bitmask has shape {tuple(bitmask.shape)}; logits of shape {tuple(logits.shape)} need {expected}"
        )
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
