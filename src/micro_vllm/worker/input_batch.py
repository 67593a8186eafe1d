"""The runner's persistent batch: per-request token ids, progress and block tables as numpy rows.

Rows survive from step to step and are updated from the plan's deltas, so preparing a step is a
few vectorized gathers instead of rebuilding Python lists for every request.

Requests that use vLLM's logits processors (``sampling/logits_processors.py``) keep their settings
with their row, and ``logits_processors_metadata`` gathers a step's inputs for those rows only. The
penalties count tokens on the device (``TokenCounts``), so that the token a step samples counts at
the next step although the host does not know it yet (async scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from micro_vllm.core.scheduler_output import BlockIds, NewRequestData
from micro_vllm.cpu_gpu_buffer import to_device
from micro_vllm.sampling.logits_processors import LogitsProcessorsMetadata, Penalties, TokenBiases
from micro_vllm.sampling.params import SamplingParams


@dataclass(frozen=True)
class RequestProcessors:
    """What the logits processors need to know about one request, kept with its row."""

    params: SamplingParams
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    min_tokens_stop_ids: tuple[int, ...]  # EOS and stop_token_ids, as vLLM holds back both

    @classmethod
    def of(cls, new: NewRequestData, vocab_size: int) -> RequestProcessors | None:
        """The request's settings, or None when it uses no processor."""
        params = new.sampling_params
        stop_ids = ()
        if params.min_tokens:  # ids past the vocabulary can never be sampled anyway
            stop_ids = tuple(sorted(t for t in new.eos_token_ids | set(params.stop_token_ids) if t < vocab_size))
        processors = cls(params, new.bad_words_token_ids, stop_ids)
        used = (processors.uses_penalties or params.logit_bias or params.allowed_token_ids is not None
                or new.bad_words_token_ids or stop_ids)
        return processors if used else None

    @property
    def uses_penalties(self) -> bool:
        params = self.params
        return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


class TokenCounts:
    """The tokens of each row as the penalties need them, on the device: how often each token occurs
    in the output, and whether it occurs in the prompt. A row is rebuilt from its request's tokens
    when the request is (re)added, and each step's sampled tokens are counted on the device."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.output = torch.zeros((max_num_reqs, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((max_num_reqs, vocab_size), dtype=torch.bool, device=device)

    def reset_row(self, row: int, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        tokens = to_device(token_ids.astype(np.int64), self.device)
        self.prompt_mask[row] = False
        self.prompt_mask[row, tokens[:num_prompt_tokens]] = True
        self.output[row] = 0
        self.count(torch.full_like(tokens[num_prompt_tokens:], row), tokens[num_prompt_tokens:])

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.output.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.int32), accumulate=True)

    def move_row(self, src: int, dst: int) -> None:
        self.output[dst] = self.output[src]
        self.prompt_mask[dst] = self.prompt_mask[src]


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: list[int], vocab_size: int,
                 device: torch.device) -> None:
        self.req_ids: list[str] = []  # row i holds req_ids[i]; rows stay dense
        self.row_of: dict[str, int] = {}
        # Changes whenever a row may change hands (a request leaves, or the last row moves into its
        # place): what a step derived from its rows (its sampling settings, where its sampled tokens
        # go) stays valid while this is unchanged. A new request only ever takes a row past the end.
        self.rows_version = 0
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # with those sampled but not yet on the host
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        self.block_tables = [np.zeros((max_num_reqs, n), np.int32) for n in max_blocks_per_req]
        self.num_blocks = [np.zeros(max_num_reqs, np.int32) for _ in max_blocks_per_req]
        self.temperature = np.zeros(max_num_reqs, np.float32)
        self.top_k = np.zeros(max_num_reqs, np.int32)
        self.top_p = np.ones(max_num_reqs, np.float32)
        self.seed = np.full(max_num_reqs, -1, np.int64)  # -1: no seed of its own, or greedy
        # How many top logprobs a row asks for, of its samples and of its prompt; -1: none.
        self.num_logprobs = np.full(max_num_reqs, -1, np.int32)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, np.int32)
        # Where the row's token is in the last step's sampled tensor; -1: it sampled nothing there.
        self.last_sample_index = np.full(max_num_reqs, -1, np.int64)
        self.min_p = np.zeros(max_num_reqs, np.float32)
        self.uses_processors = np.zeros(max_num_reqs, bool)
        self.processors = np.full(max_num_reqs, None, object)  # RequestProcessors, or None
        self.vocab_size, self.device = vocab_size, device
        self.token_counts: TokenCounts | None = None  # allocated for the first request with penalties

    def __len__(self) -> int:
        return len(self.req_ids)

    def clear(self) -> None:
        """Drop every row; ``add_request`` writes all of a row's fields again."""
        self.req_ids.clear()
        self.row_of.clear()
        self.rows_version += 1

    def add_request(self, new: NewRequestData) -> None:
        row = len(self.req_ids)
        self.req_ids.append(new.req_id)
        self.row_of[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        for group_id in range(len(self.block_tables)):
            self.num_blocks[group_id][row] = 0
        self.append_block_ids(np.array([row]), [new.block_ids])
        params = new.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = params.top_p
        self.seed[row] = params.seed if params.seed is not None and not params.greedy else -1
        self.last_sample_index[row] = -1
        self.min_p[row] = 0 if params.greedy else params.min_p  # min-p never changes an argmax
        processors = RequestProcessors.of(new, self.vocab_size)
        self.processors[row] = processors
        self.uses_processors[row] = processors is not None
        if processors is not None and processors.uses_penalties:
            if self.token_counts is None:
                self.token_counts = TokenCounts(len(self.processors), self.vocab_size, self.device)
            self.token_counts.reset_row(row, self.token_ids[row, :n], new.num_prompt_tokens)
        self.num_logprobs[row] = self._num_logprobs(params.logprobs)
        # A request resumed after preemption with output tokens had its whole prompt's logprobs already;
        # a one-token prompt has none to compute.
        needs_prompt_logprobs = n == new.num_prompt_tokens and n > 1
        self.num_prompt_logprobs[row] = self._num_logprobs(params.prompt_logprobs) if needs_prompt_logprobs else -1

    def _num_logprobs(self, requested: int | None) -> int:
        if requested is None:
            return -1
        return self.vocab_size if requested == -1 else requested

    def append_block_ids(self, rows: np.ndarray, block_ids: list[BlockIds]) -> None:
        """Append each row's new blocks (``block_ids[i]``, one tuple per KV cache group, to
        ``rows[i]``, distinct rows) to its block tables."""
        for table, count, ids_of_rows in zip(self.block_tables, self.num_blocks, zip(*block_ids)):
            if len(rows) > 1 and set(map(len, ids_of_rows)) == {1}:
                # One block each (decodes that filled a block): in one scatter, not a call per row.
                start = count[rows]
                table[rows, start] = [ids[0] for ids in ids_of_rows]
                count[rows] = start + 1
                continue
            for row, ids in zip(rows.tolist(), ids_of_rows):
                if ids:
                    start = int(count[row])
                    table[row, start : start + len(ids)] = ids
                    count[row] = start + len(ids)

    def remove_request(self, req_id: str) -> None:
        """Free a row, moving the last row into it so that rows stay dense."""
        row = self.row_of.pop(req_id)
        last = len(self.req_ids) - 1
        self.rows_version += 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.row_of[moved] = row
            for array in (self.num_prompt_tokens, self.num_tokens, self.num_computed_tokens, self.temperature,
                          self.top_k, self.top_p, self.seed, self.last_sample_index, self.num_logprobs,
                          self.num_prompt_logprobs, self.min_p, self.uses_processors, self.processors,
                          *self.num_blocks):
                array[row] = array[last]
            if self.token_counts is not None:
                self.token_counts.move_row(last, row)
            n = self.num_tokens[row]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for table, count in zip(self.block_tables, self.num_blocks):
                table[row, : count[row]] = table[last, : count[row]]
        self.req_ids.pop()

    def logits_processors_metadata(self, rows: np.ndarray, last_sampled: torch.Tensor | None
                                   ) -> LogitsProcessorsMetadata:
        """The processors' inputs for a step whose sampling rows are the batch rows ``rows``, gathered
        for the rows that use a processor. ``last_sampled``: the last step's tokens while the host
        does not have them (``last_sample_index`` says which one is a row's).

        Bad words need the output's last tokens. All but the newest are on the host; the newest may
        still be on the device, so the host matches the rest of the word and the device compares the
        newest token with the word's last prefix token: exact under async scheduling, and nothing
        waits for the device."""
        allowed_rows, allowed_entries = [], ([], [])  # step rows; (step row, token id) of each allowed
        biases = ([], [], [])  # step row, token id, value
        pending = ([], [], [], [])  # step row, token id, index in last_sampled, the token it must be
        penalty_rows = ([], [])  # step row, batch row
        for i in np.flatnonzero(self.uses_processors[rows]).tolist():
            row = int(rows[i])
            processors: RequestProcessors = self.processors[row]
            params = processors.params
            num_prompt_tokens, num_tokens = int(self.num_prompt_tokens[row]), int(self.num_tokens[row])
            if params.allowed_token_ids is not None:
                allowed_rows.append(i)
                _extend(allowed_entries, i, params.allowed_token_ids)
            if num_tokens - num_prompt_tokens < params.min_tokens:
                stop_ids = processors.min_tokens_stop_ids
                _extend(biases, i, stop_ids, [-np.inf] * len(stop_ids))
            if params.logit_bias:
                _extend(biases, i, params.logit_bias.keys(), params.logit_bias.values())
            if processors.bad_words_token_ids:
                newest = int(self.last_sample_index[row]) if last_sampled is not None else -1
                output = self.token_ids[row, num_prompt_tokens:num_tokens - (newest >= 0)].tolist()
                banned, pending_bans = _bad_word_bans(processors.bad_words_token_ids, output, newest >= 0)
                _extend(biases, i, banned, [-np.inf] * len(banned))
                for token_id, newest_token_id in pending_bans:
                    _extend(pending, i, [token_id], [newest], [newest_token_id])
            if processors.uses_penalties:
                _extend(penalty_rows, i, [row])

        device = self.device
        on_device = lambda values, dtype=np.int64: to_device(np.array(values, dtype), device)  # noqa: E731
        metadata = LogitsProcessorsMetadata()
        if allowed_rows:
            metadata.allowed_rows = on_device(allowed_rows)
            metadata.allowed_token_ids = (on_device(allowed_entries[0]), on_device(allowed_entries[1]))
        num_pending = len(pending[0])
        _extend(biases, pending[0], pending[1], [0.0] * num_pending)
        if biases[0]:
            values = on_device(biases[2], np.float32)
            if num_pending:  # -inf where the row's newest token is the word's last prefix token
                matched = last_sampled[on_device(pending[2])] == on_device(pending[3])
                values[len(values) - num_pending:].masked_fill_(matched, float("-inf"))
            metadata.token_biases = TokenBiases(on_device(biases[0]), on_device(biases[1]), values)
        if penalty_rows[0]:
            step_rows, batch_rows = penalty_rows
            params = [self.processors[row].params for row in batch_rows]
            batch_rows = on_device(batch_rows)
            metadata.penalties = Penalties(
                rows=on_device(step_rows),
                presence=on_device([p.presence_penalty for p in params], np.float32),
                frequency=on_device([p.frequency_penalty for p in params], np.float32),
                repetition=on_device([p.repetition_penalty for p in params], np.float32),
                output_token_counts=self.token_counts.output[batch_rows],
                prompt_token_mask=self.token_counts.prompt_mask[batch_rows],
                batch_rows=batch_rows,
            )
        return metadata


def _extend(entries: tuple[list, ...], rows: int | list[int], *columns) -> None:
    """Append entries to parallel lists: the step row (one for all, or one each), then the columns."""
    columns = [list(column) for column in columns]
    entries[0].extend(rows if isinstance(rows, list) else [rows] * len(columns[0]))
    for entry, column in zip(entries[1:], columns):
        entry.extend(column)


def _bad_word_bans(words: tuple[tuple[int, ...], ...], output: list[int], newest_on_device: bool
                   ) -> tuple[list[int], list[tuple[int, int]]]:
    """The last tokens of the bad words whose other tokens end the output (vLLM's rule): those banned
    now, and (token id, the newest output token it takes) for those the device must decide.
    ``output`` holds the output tokens the host has; with ``newest_on_device`` one more is coming."""
    banned, pending = [], []
    for word in words:
        prefix = word[:-1]
        if newest_on_device and prefix:
            if _ends_with(output, prefix[:-1]):
                pending.append((word[-1], prefix[-1]))
        elif _ends_with(output, prefix):
            banned.append(word[-1])
    return banned, pending


def _ends_with(tokens: list[int], suffix: tuple[int, ...]) -> bool:
    return len(suffix) <= len(tokens) and tuple(tokens[len(tokens) - len(suffix):]) == suffix
