"""The runner's persistent batch on its own: block ids appended step by step land after each row's
earlier ones, whichever way a step's ids are written (one block for every row of a group, or not);
rows follow the step's order, with their tokens, blocks and settings, and the sampling metadata is
made from the step's rows."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from micro_vllm.core.scheduler_output import CachedRequestData, NewRequestData
from micro_vllm.sampling.params import SamplingParams
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


def new_request(req_id: str, prompt: list[int], block: int, **params) -> NewRequestData:
    return NewRequestData(req_id, tuple(prompt), len(prompt), SamplingParams(**params), ((block,),), 0)


def cached(req_ids: list[str], new_token_ids: list[tuple[int, ...]]) -> CachedRequestData:
    return CachedRequestData(tuple(req_ids), tuple(new_token_ids), (None,) * len(req_ids), (0,) * len(req_ids))


def test_rows_follow_the_step_with_their_tokens_blocks_and_settings():
    batch = InputBatch(4, 16, [4], 32, torch.device("cpu"))
    for new in (new_request("a", [1, 2], 5, temperature=0.5, top_k=3),
                new_request("b", [3, 4, 5], 6, temperature=0.0),
                new_request("c", [6], 7, temperature=1.0, top_p=0.75, seed=11, presence_penalty=0.5)):
        batch.add_request(new)

    def step(req_ids: list[str], new_tokens: list[tuple[int, ...]]) -> None:
        batch.arrange(req_ids)
        batch.update_cached(cached(req_ids, new_tokens))
        if batch.changed:
            batch.refresh_sampling_metadata()

    def rows() -> dict[str, tuple]:
        return {req_id: (batch.token_ids[row, : batch.num_tokens[row]].tolist(), int(batch.block_tables[0][row, 0]),
                         float(batch.temperature.np[row]), int(batch.seed[row]), bool(batch.uses_penalties[row]))
                for row, req_id in enumerate(batch.req_ids)}

    step(["a", "b", "c"], [(), (), ()])
    before = rows()
    metadata = batch.sampling_metadata
    assert metadata.temperature.tolist() == [0.5, 0.0, 1.0] and metadata.top_k.tolist() == [3, 0, 0]
    assert metadata.top_p.tolist() == [1.0, 1.0, 0.75] and not metadata.all_greedy and not metadata.all_random
    assert metadata.max_top_k == 4 and metadata.top_p_without_top_k  # "c" has top-p alone
    assert metadata.logits_processors.penalties.presence.tolist() == [0.0, 0.0, 0.5]  # only "c" has one
    step(["a", "b", "c"], [(9,), (), (8, 7)])  # the same rows: the metadata is the last step's
    assert batch.sampling_metadata is metadata
    assert [batch.token_ids[row, : batch.num_tokens[row]].tolist() for row in range(3)] == [[1, 2, 9], [3, 4, 5],
                                                                                           [6, 8, 7]]
    # "a" leaves; "b" sits this step out, behind "c"; then comes back after it.
    batch.remove_requests(["a", "unknown"])
    step(["c"], [()])
    assert batch.req_ids == ["c", "b"] and batch.num_reqs == 1
    assert rows() == {"c": ([6, 8, 7], 7, 1.0, 11, True), "b": before["b"]}
    assert batch.sampling_metadata.temperature.tolist() == [1.0]
    assert batch.sampling_metadata.max_top_k is None and batch.sampling_metadata.top_p_without_top_k
    assert batch.sampling_metadata.logits_processors.penalties.presence.tolist() == [0.5]
    step(["c", "b"], [(), (4,)])
    assert batch.req_ids == ["c", "b"] and rows()["b"][0] == [3, 4, 5, 4]
    assert batch.sampling_metadata.temperature.tolist() == [1.0, 0.0]
    assert batch.row_seeds(np.array([5, 4], np.int32)) == {0: hash((11, 4)) & (2**63 - 1)}  # the output position


def test_token_counts_follow_the_rows_of_requests_with_penalties():
    """The device counts of each row with penalties equal its tokens': the rows added in a step are
    rebuilt together, also when rows move before the metadata is made, and sampled tokens add up."""
    batch = InputBatch(4, 16, [4], 32, torch.device("cpu"))

    def resumed(req_id: str, prompt: list[int], output: list[int], **params) -> NewRequestData:
        return NewRequestData(req_id, (*prompt, *output), len(prompt), SamplingParams(**params), ((1,),), 0)

    def assert_counts_match() -> None:
        counts = batch.token_counts
        for row in np.flatnonzero(batch.uses_penalties[: len(batch)]).tolist():
            tokens, num_prompt = batch.token_ids[row, : batch.num_tokens[row]], batch.num_prompt_tokens[row]
            expected_output = np.bincount(tokens[num_prompt:], minlength=32)
            assert counts.output[row].tolist() == expected_output.tolist(), batch.req_ids[row]
            assert counts.prompt_mask[row].tolist() == [t in set(tokens[:num_prompt]) for t in range(32)]

    batch.add_request(resumed("a", [1, 2, 2], [7], presence_penalty=1.0))
    batch.add_request(resumed("b", [3], [], temperature=0.5))
    batch.add_request(resumed("c", [4, 5], [6, 6, 9], repetition_penalty=1.2))
    batch.remove_requests(["a"])  # "c" moves up before any metadata was made
    batch.add_request(resumed("d", [9, 9], [], frequency_penalty=0.5))
    batch.arrange(["b", "c", "d"])
    batch.refresh_sampling_metadata()
    assert batch.req_ids == ["b", "c", "d"]
    assert_counts_match()
    batch.update_cached(cached(["b", "c", "d"], [(8,), (6,), (2,)]))  # each row samples a token
    batch.count_sampled_tokens(torch.tensor([8, 6, 2]), np.ones(3, bool))
    batch.add_request(resumed("e", [2], [3, 3], presence_penalty=0.3))  # into the row "a" left
    batch.arrange(["e", "d", "c", "b"])
    batch.refresh_sampling_metadata()
    assert_counts_match()
    penalties = batch.sampling_metadata.logits_processors.penalties
    assert penalties.presence.tolist() == [np.float32(0.3), 0, 0, 0]  # every row's, 0 where it has none
    assert penalties.repetition.tolist() == [1, 1, np.float32(1.2), 1]
