"""The runner's persistent batch (vLLM's ``InputBatch``): one row per request the runner holds, as
numpy columns that persist across steps and change only by the plans' deltas.

The batch's first ``num_reqs`` rows are the step's requests in the step's order: the plan's cached
requests, then its new ones (``arrange``). So row i is the step's request i, and its logits row and
sampled token are row i too; a step gathers nothing by request. The requests a plan leaves out for a
step keep their rows behind those, and are moved back in when planned again.

The sampling settings are columns too, and the batch's ``SamplingMetadata`` is made from them when
its rows change (``refresh_sampling_metadata``): for most steps, the last one serves. What depends
on the step is added to it per step: the seeds of seeded rows (``row_seeds``: a row's seed and the
position of the token it samples) and the tokens ``min_tokens`` and ``bad_words`` ban
(``step_sampling_metadata``).

The token ids are the plans' (a new request's, then each step's ``new_token_ids``); the newest token
of a request may still be on the device only, where the last step sampled it. The penalties count
tokens on the device (``TokenCounts``), and bad words compare the newest token on the device, so that
async scheduling needs no token on the host before the step that follows it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from micro_vllm.core.scheduler_output import BlockIds, CachedRequestData, NewRequestData
from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer, to_device
from micro_vllm.sampling.logits_processors import LogitsProcessorsMetadata, Penalties, TokenBiases
from micro_vllm.sampling.params import SamplingParams
from micro_vllm.sampling.sampler import SamplingMetadata, max_top_k


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
    def bans_tokens(self) -> bool:
        """Whether ``min_tokens`` or ``bad_words`` may ban tokens at a step."""
        return bool(self.min_tokens_stop_ids or self.bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        params = self.params
        return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


class TokenCounts:
    """The tokens of each row as the penalties need them, on the device: how often each token occurs
    in the output, and whether it occurs in the prompt. A row is rebuilt from its request's tokens
    when the request is (re)added, all such rows of a step at once (``rebuild``: a prefill step may
    add hundreds, and a few launches for all of them cost less than a few each), and each step's
    sampled tokens are counted on the device."""

    COUNT_DTYPE, MASK_DTYPE = torch.int32, torch.bool

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.output = torch.zeros((max_num_reqs, vocab_size), dtype=self.COUNT_DTYPE, device=device)
        self.prompt_mask = torch.zeros((max_num_reqs, vocab_size), dtype=self.MASK_DTYPE, device=device)
        self.to_rebuild: dict[int, tuple[np.ndarray, int]] = {}  # row -> (its token ids, how many are the prompt's)

    @staticmethod
    def nbytes(max_num_reqs: int, vocab_size: int) -> int:
        """The device memory a ``TokenCounts(max_num_reqs, vocab_size)`` takes."""
        return max_num_reqs * vocab_size * (TokenCounts.COUNT_DTYPE.itemsize + TokenCounts.MASK_DTYPE.itemsize)

    def reset_row(self, row: int, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        """Give ``row`` these tokens at the next ``rebuild``."""
        # A copy: the batch may move its rows' tokens before the rebuild.
        self.to_rebuild[row] = (token_ids.astype(np.int64), num_prompt_tokens)

    def rebuild(self) -> None:
        """Rebuild the rows reset since the last call, in one copy to the device."""
        if not self.to_rebuild:
            return
        rows = np.fromiter(self.to_rebuild, np.int64, len(self.to_rebuild))
        token_ids = [tokens for tokens, _ in self.to_rebuild.values()]
        flat = np.repeat(rows, list(map(len, token_ids))) * self.output.shape[1] + np.concatenate(token_ids)
        in_prompt = np.concatenate([np.arange(len(tokens)) < n for tokens, n in self.to_rebuild.values()])
        num_prompt = int(in_prompt.sum())
        on_device = to_device(np.concatenate([rows, flat[in_prompt], flat[~in_prompt]]), self.device)
        rows, prompt_flat, output_flat = on_device.split([len(rows), num_prompt, len(flat) - num_prompt])
        self.output[rows] = 0
        self.prompt_mask[rows] = False
        self.prompt_mask.view(-1)[prompt_flat] = True
        self._count_flat(output_flat)
        self.to_rebuild.clear()

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.rebuild()
        self._count_flat(rows * self.output.shape[1] + token_ids)

    def _count_flat(self, flat: torch.Tensor) -> None:
        # index_add_ counts a repeated (row, token) with atomic adds in one kernel, where index_put_'s
        # accumulate sorts the indices first.
        self.output.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def move_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.rebuild()
        dst, src = to_device(dst, self.device), to_device(src, self.device)
        self.output[dst] = self.output[src]
        self.prompt_mask[dst] = self.prompt_mask[src]


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: list[int], vocab_size: int,
                 device: torch.device) -> None:
        self.req_ids: list[str] = []  # row i holds req_ids[i]
        self.row_of: dict[str, int] = {}
        self.num_reqs = 0  # the step's requests: rows [0, num_reqs)
        self.vocab_size, self.device = vocab_size, device
        column = lambda dtype, fill=0: np.full(max_num_reqs, fill, dtype)  # noqa: E731
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = column(np.int32)  # those whose ids the plans gave
        self.num_prompt_tokens = column(np.int32)
        self.num_computed_tokens = column(np.int32)
        self.block_tables = [np.zeros((max_num_reqs, n), np.int32) for n in max_blocks_per_req]
        self.num_blocks = [column(np.int32) for _ in max_blocks_per_req]
        # The sampling settings, staged for the device, where they are copied when the rows change.
        staged = lambda dtype: CpuGpuBuffer((max_num_reqs,), dtype, device)  # noqa: E731
        self.temperature = staged(torch.float32)
        self.top_k = staged(torch.int32)  # 0: off
        self.top_p = staged(torch.float32)
        self.min_p = staged(torch.float32)
        self.seed = column(np.int64, -1)  # -1: no seed of its own, or greedy
        # How many top logprobs a row asks for, of its samples and of its prompt; -1: none.
        self.num_logprobs = column(np.int32, -1)
        self.num_prompt_logprobs = column(np.int32, -1)
        self.processors = column(object, None)  # RequestProcessors, or None
        self.uses_processors = column(bool)
        self.uses_penalties = column(bool)
        self.bans_tokens = column(bool)  # the rows a step's bans may concern, which it visits alone
        self.token_counts: TokenCounts | None = None  # allocated for the first request with penalties
        # Every one-value-per-row column: they move with their rows (``_reorder``).
        self.columns = [self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, *self.num_blocks,
                        self.temperature.np, self.top_k.np, self.top_p.np, self.min_p.np, self.seed,
                        self.num_logprobs, self.num_prompt_logprobs, self.processors, self.uses_processors,
                        self.uses_penalties, self.bans_tokens]
        self.changed = True  # the rows changed since the sampling metadata was made
        self.sampling_metadata: SamplingMetadata | None = None

    def __len__(self) -> int:
        return len(self.req_ids)

    def clear(self) -> None:
        """Drop every row; ``add_request`` writes all of a row's fields again."""
        self.req_ids.clear()
        self.row_of.clear()
        self.num_reqs = 0
        self.changed = True

    # -- the plan's deltas ---------------------------------------------------------------------

    def add_request(self, new: NewRequestData) -> None:
        """Give a request the row after the last."""
        row = len(self.req_ids)
        self.req_ids.append(new.req_id)
        self.row_of[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        for num_blocks in self.num_blocks:
            num_blocks[row] = 0
        self.append_block_ids(np.array([row]), [new.block_ids])
        params = new.sampling_params
        self.temperature.np[row] = params.temperature
        self.top_k.np[row] = max(params.top_k, 0)
        self.top_p.np[row] = params.top_p
        self.min_p.np[row] = 0 if params.greedy else params.min_p  # min-p never changes an argmax
        self.seed[row] = params.seed if params.seed is not None and not params.greedy else -1
        self.num_logprobs[row] = self._num_logprobs(params.logprobs)
        # A request resumed after preemption with output tokens had its whole prompt's logprobs already;
        # a one-token prompt has none to compute.
        needs_prompt_logprobs = n == new.num_prompt_tokens and n > 1
        self.num_prompt_logprobs[row] = self._num_logprobs(params.prompt_logprobs) if needs_prompt_logprobs else -1
        processors = RequestProcessors.of(new, self.vocab_size)
        self.processors[row] = processors
        self.uses_processors[row] = processors is not None
        self.uses_penalties[row] = processors is not None and processors.uses_penalties
        self.bans_tokens[row] = processors is not None and processors.bans_tokens
        if self.uses_penalties[row]:
            if self.token_counts is None:
                self.token_counts = TokenCounts(len(self.processors), self.vocab_size, self.device)
            self.token_counts.reset_row(row, self.token_ids[row, :n], new.num_prompt_tokens)
        self.changed = True

    def _num_logprobs(self, requested: int | None) -> int:
        if requested is None:
            return -1
        return self.vocab_size if requested == -1 else requested

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Drop the rows of those of ``req_ids`` the batch holds; the rows after them move up."""
        rows = [self.row_of[req_id] for req_id in req_ids if req_id in self.row_of]
        if rows:
            self._reorder(np.delete(np.arange(len(self.req_ids)), rows))

    def arrange(self, req_ids: list[str]) -> None:
        """Make ``req_ids``, the step's requests, rows [0, len(req_ids)) in this order; the others
        keep their order after them."""
        n = len(req_ids)
        if n == self.num_reqs and self.req_ids[:n] == req_ids:
            return
        step_rows = np.fromiter(map(self.row_of.__getitem__, req_ids), np.int64, n)
        left_out = np.ones(len(self.req_ids), bool)
        left_out[step_rows] = False
        self._reorder(np.concatenate([step_rows, np.flatnonzero(left_out)]))
        self.num_reqs = n

    def _reorder(self, order: np.ndarray) -> None:
        """Row i takes what row ``order[i]`` held; rows past ``len(order)`` are dropped. Only the
        used part of a row's tokens and block tables is moved."""
        moved = np.flatnonzero(order != np.arange(len(order)))
        if len(moved):
            src = order[moved]
            width = int(self.num_tokens[src].max())
            self.token_ids[moved, :width] = self.token_ids[src, :width]
            for table, num_blocks in zip(self.block_tables, self.num_blocks):
                width = int(num_blocks[src].max())
                table[moved, :width] = table[src, :width]
            for column in self.columns:
                column[moved] = column[src]
            if self.token_counts is not None:
                self.token_counts.move_rows(moved, src)
        self.req_ids = [self.req_ids[row] for row in order.tolist()]
        self.row_of = {req_id: row for row, req_id in enumerate(self.req_ids)}
        self.changed = True

    def update_cached(self, cached: CachedRequestData) -> None:
        """Apply the deltas of the plan's cached requests, rows [0, len(cached.req_ids)) once
        arranged: how far each is computed, its new blocks and its new tokens."""
        n = len(cached.req_ids)
        if not n:
            return
        self.num_computed_tokens[:n] = cached.num_computed_tokens
        new_block_ids = cached.new_block_ids
        # A request's BlockIds holds a tuple per group, so it is never empty: only None is false.
        with_blocks = list(itertools.compress(range(n), new_block_ids))
        if with_blocks:  # most decodes get no new block
            self.append_block_ids(np.array(with_blocks), [new_block_ids[i] for i in with_blocks])
        counts = np.fromiter(map(len, cached.new_token_ids), np.int64, n)
        total = int(counts.sum())
        if total:  # each row's new tokens go after its known ones
            rows = np.repeat(np.arange(n), counts)
            offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            tokens = np.fromiter(itertools.chain.from_iterable(cached.new_token_ids), np.int32, total)
            self.token_ids[rows, self.num_tokens[rows] + offsets] = tokens
            self.num_tokens[:n] += counts.astype(np.int32)

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

    # -- sampling ------------------------------------------------------------------------------

    def refresh_sampling_metadata(self) -> None:
        """Make the sampling metadata of the step's rows from their columns (called when the rows
        changed): the settings are copied to the device without blocking."""
        n = self.num_reqs
        temperature, top_k, top_p, min_p = (c.np[:n] for c in (self.temperature, self.top_k, self.top_p, self.min_p))
        num_logprobs = int(self.num_logprobs[:n].max(initial=-1))
        self.sampling_metadata = SamplingMetadata(
            temperature=self.temperature.copy_to_device(n),
            top_k=self.top_k.copy_to_device(n) if top_k.any() else None,
            top_p=self.top_p.copy_to_device(n) if (top_p < 1).any() else None,
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature > 0).all()),
            max_num_logprobs=num_logprobs if num_logprobs >= 0 else None,
            logits_processors=self._logits_processors() if self.uses_processors[:n].any() else None,
            min_p=self.min_p.copy_to_device(n) if (min_p > 0).any() else None,
            max_top_k=max_top_k(top_k),
            top_p_without_top_k=bool(((top_p < 1) & (top_k == 0)).any()),
        )
        self.changed = False

    def _logits_processors(self) -> LogitsProcessorsMetadata:
        """The processors' inputs that last as long as the rows: ``allowed_token_ids``, ``logit_bias``
        and the penalties (whose token counts the device keeps up to date)."""
        allowed_rows, allowed_entries = [], ([], [])  # rows; (row, token id) of each allowed token
        biases = ([], [], [])  # row, token id, value
        for row in np.flatnonzero(self.uses_processors[: self.num_reqs]).tolist():
            params = self.processors[row].params
            if params.allowed_token_ids is not None:
                allowed_rows.append(row)
                _extend(allowed_entries, row, params.allowed_token_ids)
            if params.logit_bias:
                _extend(biases, row, params.logit_bias.keys(), params.logit_bias.values())
        fields = {}
        if allowed_rows:
            fields["allowed_rows"] = _on_device(allowed_rows, self.device)
            fields["allowed_token_ids"] = tuple(_on_device(entries, self.device) for entries in allowed_entries)
        if biases[0]:
            fields["logit_bias"] = self._token_biases(biases)
        penalty_rows = np.flatnonzero(self.uses_penalties[: self.num_reqs])
        if len(penalty_rows):
            # Every row's (0, 0 and 1 where it has none, which the Triton pass only copies), in one
            # copy to the device.
            settings = np.zeros((3, self.num_reqs), np.float32)
            settings[2] = 1
            for row in penalty_rows.tolist():
                params = self.processors[row].params
                settings[:, row] = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
            presence, frequency, repetition = to_device(settings, self.device)
            self.token_counts.rebuild()
            fields["penalties"] = Penalties(presence, frequency, repetition, self.token_counts.output,
                                            self.token_counts.prompt_mask)
        return LogitsProcessorsMetadata(**fields)

    def step_sampling_metadata(self, seq_lens: np.ndarray, prev_sampled_token_ids: torch.Tensor | None,
                               prev_req_id_to_index: dict[str, int]) -> SamplingMetadata:
        """The batch's sampling metadata with the tokens this step bans: a row's ``min_tokens`` stop
        tokens while its output is shorter, and the last token of each bad word whose other tokens
        end its output. ``seq_lens``: each row's tokens once the step is computed; a row that has one
        token more than the batch knows finds it in ``prev_sampled_token_ids``.

        All but a row's newest output token are on the host; the newest may still be on the device,
        so the host matches the rest of the word and the device compares the newest token with the
        word's last prefix token: exact under async scheduling, and nothing waits for the device."""
        metadata = self.sampling_metadata
        if metadata.logits_processors is None:
            return metadata
        bans = ([], [], [])  # row, token id, value
        pending = ([], [], [], [])  # row, token id, index in prev_sampled_token_ids, the token it must be
        for row in np.flatnonzero(self.bans_tokens[: self.num_reqs]).tolist():
            processors: RequestProcessors = self.processors[row]
            num_prompt_tokens, num_known = int(self.num_prompt_tokens[row]), int(self.num_tokens[row])
            if seq_lens[row] - num_prompt_tokens < processors.params.min_tokens:
                _extend(bans, row, processors.min_tokens_stop_ids, [-np.inf] * len(processors.min_tokens_stop_ids))
            if processors.bad_words_token_ids:
                newest = prev_req_id_to_index.get(self.req_ids[row], -1) if seq_lens[row] > num_known else -1
                output = self.token_ids[row, num_prompt_tokens:num_known].tolist()
                banned, pending_bans = _bad_word_bans(processors.bad_words_token_ids, output, newest >= 0)
                _extend(bans, row, banned, [-np.inf] * len(banned))
                for token_id, newest_token_id in pending_bans:
                    _extend(pending, row, [token_id], [newest], [newest_token_id])
        num_pending = len(pending[0])
        _extend(bans, pending[0], pending[1], [0.0] * num_pending)
        if not bans[0]:
            return metadata
        token_bans = self._token_biases(bans)
        if num_pending:  # -inf where the row's newest token is the word's last prefix token
            matched = (prev_sampled_token_ids[_on_device(pending[2], self.device)]
                       == _on_device(pending[3], self.device))
            token_bans.values[len(bans[0]) - num_pending:].masked_fill_(matched, float("-inf"))
        return replace(metadata, logits_processors=replace(metadata.logits_processors, bans=token_bans))

    def _token_biases(self, entries: tuple[list, list, list]) -> TokenBiases:
        rows, token_ids, values = entries
        return TokenBiases(_on_device(rows, self.device), _on_device(token_ids, self.device),
                           _on_device(values, self.device, np.float32))

    def row_seeds(self, seq_lens: np.ndarray) -> dict[int, int]:
        """The seed of each seeded row for the token it samples this step. A seeded row's randomness
        depends only on (seed, output position): it survives preemption and does not depend on what
        else is in the batch."""
        seeded = np.flatnonzero(self.seed[: self.num_reqs] >= 0)
        if not len(seeded):
            return {}
        positions = seq_lens[seeded] - self.num_prompt_tokens[seeded]
        return {int(row): hash((int(self.seed[row]), int(position))) & (2**63 - 1)
                for row, position in zip(seeded, positions)}

    def count_sampled_tokens(self, sampled_token_ids: torch.Tensor, samples: np.ndarray) -> None:
        """Count, on the device, the tokens the rows with penalties sampled (``samples``: whose
        sample is a new token, not a prompt chunk's)."""
        rows = np.flatnonzero(self.uses_penalties[: self.num_reqs] & samples)
        if len(rows):
            rows = to_device(rows, self.device)
            self.token_counts.count(rows, sampled_token_ids[rows])


def _on_device(values: list, device: torch.device, dtype=np.int64) -> torch.Tensor:
    return to_device(np.array(values, dtype), device)


def _extend(entries: tuple[list, ...], rows: int | list[int], *columns) -> None:
    """Append entries to parallel lists: the row (one for all, or one each), then the columns."""
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
