"""The runner's persistent batch on its own: block ids appended step by step land after each row's
earlier ones, whichever way a step's ids are written (one block for every row of a group, or not)."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from micro_vllm.worker.input_batch import InputBatch

NUM_ROWS, NUM_GROUPS = 5, 2

# Per step: for each row that gets blocks, its row and how many new ids each group gets (0 to 2).
_steps = st.lists(
    st.dictionaries(st.integers(0, NUM_ROWS - 1), st.tuples(*[st.integers(0, 2)] * NUM_GROUPS), min_size=1),
    min_size=1, max_size=6,
)


@given(_steps, st.booleans())
def test_appended_block_ids_follow_each_rows_earlier_ones(steps, one_each_first):
    if one_each_first:  # a step in which every row gets one block in every group
        steps = [{row: (1,) * NUM_GROUPS for row in range(NUM_ROWS)}, *steps]
    batch = InputBatch(NUM_ROWS, 64, [16] * NUM_GROUPS, 10, torch.device("cpu"))
    expected = [[[] for _ in range(NUM_ROWS)] for _ in range(NUM_GROUPS)]
    next_id = 1
    for step in steps:
        rows, block_ids = [], []
        for row, counts in step.items():
            ids = []
            for group, count in enumerate(counts):
                ids.append(tuple(range(next_id, next_id + count)))
                expected[group][row] += ids[-1]
                next_id += count
            rows.append(row)
            block_ids.append(tuple(ids))
        batch.append_block_ids(np.array(rows), block_ids)
        for group in range(NUM_GROUPS):
            for row in range(NUM_ROWS):
                num_blocks = batch.num_blocks[group][row]
                assert batch.block_tables[group][row, :num_blocks].tolist() == expected[group][row]
