"""The running table's columns: reading them for a step's rows."""

import numpy as np

from helpers.core_helpers import make_request, make_scheduler


def test_index_is_a_slice_only_for_every_row():
    """A step's rows index the columns as a slice when they are every row (reads are views, updates
    in place), else as themselves: an update through the index changes only the rows planned."""
    scheduler = make_scheduler()
    requests = [make_request(4, max_tokens=5) for _ in range(3)]
    table = scheduler.table
    table.refresh(requests, scheduler.kv_cache_manager)
    every = np.arange(3)
    assert table.index(every) == slice(None)
    assert np.shares_memory(table.num_tokens[table.index(every)], table.num_tokens)
    some = np.array([0, 2])
    assert table.index(some) is some
    table.num_tokens[table.index(some)] += 1
    assert table.num_tokens.tolist() == [5, 4, 5]
    table.num_tokens[table.index(every)] += 1
    assert table.num_tokens.tolist() == [6, 5, 6]
