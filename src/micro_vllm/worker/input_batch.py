"""The runner's persistent batch: per-request token ids, progress and block tables as numpy rows.

Rows survive from step to step and are updated from the plan's deltas, so preparing a step is a
few vectorized gathers instead of rebuilding Python lists for every request.
"""

from __future__ import annotations

import numpy as np

from micro_vllm.core.scheduler_output import BlockIds, NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: list[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.req_ids: list[str] = []  # row i holds req_ids[i]; rows stay dense
        self.row_of: dict[str, int] = {}
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

    def __len__(self) -> int:
        return len(self.req_ids)

    def clear(self) -> None:
        """Drop every row; ``add_request`` writes all of a row's fields again."""
        self.req_ids.clear()
        self.row_of.clear()

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
        self.append_block_ids(row, new.block_ids)
        params = new.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = params.top_p
        self.seed[row] = params.seed if params.seed is not None and not params.greedy else -1
        self.last_sample_index[row] = -1
        self.num_logprobs[row] = self._num_logprobs(params.logprobs)
        # A request resumed after preemption with output tokens had its whole prompt's logprobs already;
        # a one-token prompt has none to compute.
        needs_prompt_logprobs = n == new.num_prompt_tokens and n > 1
        self.num_prompt_logprobs[row] = self._num_logprobs(params.prompt_logprobs) if needs_prompt_logprobs else -1

    def _num_logprobs(self, requested: int | None) -> int:
        if requested is None:
            return -1
        return self.vocab_size if requested == -1 else requested

    def append_block_ids(self, row: int, block_ids: BlockIds) -> None:
        for table, count, ids in zip(self.block_tables, self.num_blocks, block_ids):
            if ids:
                table[row, count[row] : count[row] + len(ids)] = ids
                count[row] += len(ids)

    def remove_request(self, req_id: str) -> None:
        """Free a row, moving the last row into it so that rows stay dense."""
        row = self.row_of.pop(req_id)
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.row_of[moved] = row
            for array in (self.num_prompt_tokens, self.num_tokens, self.num_computed_tokens, self.temperature,
                          self.top_k, self.top_p, self.seed, self.last_sample_index, self.num_logprobs,
                          self.num_prompt_logprobs, *self.num_blocks):
                array[row] = array[last]
            n = self.num_tokens[row]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for table, count in zip(self.block_tables, self.num_blocks):
                table[row, : count[row]] = table[last, : count[row]]
        self.req_ids.pop()
