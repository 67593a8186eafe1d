"""Pieces of the ModelRunner that run on CUDA, exercised on CPU: the step buffers' copy (on CPU a
CpuGpuBuffer's host and device sides are one tensor, so a separate twin stands in for the device
side), the start-up steps, the CUDA graph shapes and steps padded to one (decode and mixed); and the
persistent batch as the plans leave it, step after step."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from micro_vllm import LLM, SamplingParams
from micro_vllm.attention.attention import Attention
from micro_vllm.attention.backends.registry import get_backend_cls
from micro_vllm.core.kv_cache_manager import make_kv_cache_groups
from micro_vllm.cpu_gpu_buffer import CpuGpuBuffer
from micro_vllm.worker.cuda_graphs import CudaGraphs, CudaGraphShape, cudagraph_capture_shapes, pad_decode_batch
from micro_vllm.worker.dummy_run import profile_query_lens, profile_run, warm_up
from micro_vllm.worker.input_buffers import InputBuffers
from helpers.tiny_models import make_tiny_model


def _with_separate_twin(*shape: int) -> CpuGpuBuffer:
    buffer = CpuGpuBuffer(shape, torch.int32, torch.device("cpu"))
    buffer.device = torch.full(shape, -1, dtype=torch.int32)
    return buffer


def test_staged_buffer_copies_the_used_rows_of_a_vector():
    buffer = _with_separate_twin(8)
    buffer.np[:] = range(8)
    rows = buffer.copy_to_device(5)
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert buffer.device[5:].tolist() == [-1, -1, -1]  # rows past the step stay untouched


def test_staged_buffer_copies_only_the_used_columns_of_a_table():
    buffer = _with_separate_twin(4, 6)
    buffer.np[:] = torch.arange(24).reshape(4, 6).numpy()
    rows = buffer.copy_to_device(3, cols=2)
    assert rows.shape == (3, 6)
    assert rows[:, :2].tolist() == [[0, 1], [6, 7], [12, 13]]
    assert (rows[:, 2:] == -1).all() and (buffer.device[3] == -1).all()


def test_staged_buffer_copies_again_when_a_step_stages_the_same_rows():
    """The views of the last call serve the next call of the same shape: the copy is still made, and
    another shape gets its own rows."""
    buffer = _with_separate_twin(4, 6)
    buffer.np[:] = torch.arange(24).reshape(4, 6).numpy()
    first = buffer.copy_to_device(2, cols=3)
    buffer.np[:] += 100
    assert buffer.copy_to_device(2, cols=3) is first
    assert first[:, :3].tolist() == [[100, 101, 102], [106, 107, 108]]
    assert buffer.host_rows(2, cols=3).tolist() == buffer.np[:2].tolist()
    rows = buffer.copy_to_device(2, cols=4)  # one column more
    assert rows[:, :4].tolist() == buffer.np[:2, :4].tolist() and (rows[:, 4:] == -1).all()
    rows = buffer.copy_to_device(3, cols=4)
    assert rows.shape == (3, 6) and rows[:, :4].tolist() == buffer.np[:3, :4].tolist()
    assert (rows[:, 4:] == -1).all() and buffer.copy_to_device(2).tolist() == buffer.np[:2].tolist()
    assert buffer.host_rows(1).tolist() == [buffer.np[0].tolist()]


@given(st.integers(1, 1100), st.integers(1, 20_000), st.integers(1, 5000))
def test_profile_step_is_the_largest_step_the_scheduler_can_plan(max_num_seqs, budget, max_model_len):
    query_lens = profile_query_lens(max_num_seqs, budget, max_model_len)
    assert len(query_lens) == min(max_num_seqs, budget)
    assert query_lens.sum() == min(budget, len(query_lens) * max_model_len)
    assert 1 <= query_lens.min() and query_lens.max() <= max_model_len
    assert query_lens[0] == query_lens.max()  # one long prompt among the others


@pytest.mark.parametrize("custom_ops", [None, ["+sampler"]], ids=["pytorch-sampler", "triton-sampler"])
def test_start_up_steps_run_on_cpu_and_write_no_kv(tmp_path, custom_ops):
    """The profiling step and the warm-up steps (run on CUDA at start-up) on CPU with a tiny model:
    long prompts beside short ones, sampled with top-k and top-p, on each sampler route. The warm-up
    runs on the real KV cache and must leave it as it was."""
    path = make_tiny_model("qwen3", tmp_path)
    with LLM(model=str(path), device="cpu", max_model_len=64, max_num_seqs=5, max_num_batched_tokens=100,
             custom_ops=custom_ops) as llm:
        runner = llm.engine.executor.worker.model_runner
        layers = runner.model.attention_layers()
        for layer in layers:
            layer.kv_cache.normal_()
        caches = [layer.kv_cache.clone() for layer in layers]
        warm_up(runner)
        assert all(torch.equal(layer.kv_cache, cache) for layer, cache in zip(layers, caches))
        profile_run(runner)
        assert all(layer.kv_cache.numel() == 0 for layer in layers)  # as before the cache is sized
        for layer, cache in zip(layers, caches):
            layer.kv_cache = cache
            cache[:, 0].zero_()  # the null block
        output = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(output[0].outputs[0].token_ids) == 2


def test_a_decode_step_padded_to_a_graph_size_stages_dummies_that_write_nowhere():
    """Two decodes padded to a captured batch of 4: the rows past them, stale from a larger step, are
    staged as decodes of one token over the null block with no slot, and the Triton builder orders
    them after the real requests (longest context first)."""
    pytest.importorskip("triton")
    layers = [Attention(num_heads=4, head_size=16, num_kv_heads=2, scale=0.25)]
    groups = make_kv_cache_groups([layer.spec for layer in layers])
    buffers = InputBuffers(layers, get_backend_cls("triton")(), groups, max_num_reqs=8, max_num_tokens=8,
                           max_model_len=64, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
    [block_table], [slot_mapping] = buffers.block_tables, buffers.slot_mappings
    buffers.seq_lens.np[:] = 50
    slot_mapping.np[:] = 7
    block_table.np[:] = 9
    buffers.query_start_loc.np[:3] = [0, 1, 2]
    buffers.seq_lens.np[:2] = [5, 30]
    slot_mapping.np[:2] = [4 + 16, 13 + 32]
    pad_decode_batch(buffers, 2, 4)
    [metadata] = buffers.attention_metadata(4, 4, max_query_len=1, max_seq_len=30, num_cols=2)
    common = metadata.common
    assert common.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert common.seq_lens.tolist() == [5, 30, 1, 1]
    assert common.slot_mapping.tolist() == [20, 45, -1, -1]
    assert common.block_table[2:, 0].tolist() == [0, 0]
    assert buffers.input_ids.np[2:4].tolist() == [0, 0] and buffers.positions.np[2:4].tolist() == [0, 0]
    assert metadata.decode_order.tolist() == [1, 0, 2, 3]


def test_graph_shapes_cover_decodes_and_short_steps_with_prefill_chunks():
    shapes = cudagraph_capture_shapes(max_num_seqs=64, max_num_batched_tokens=100, max_model_len=200)
    decode = [s.num_reqs for s in shapes if s.uniform_decode]
    mixed = [(s.num_tokens, s.num_reqs) for s in shapes if not s.uniform_decode]
    assert decode == [8, 16, 32, 48, 64]
    assert mixed == [(32, 4), (32, 16), (64, 4), (64, 16), (64, 32), (100, 4), (100, 16), (100, 50)]
    graphs = CudaGraphs()
    graphs.shapes = sorted(shapes)
    assert graphs.shape_for(1, 1, 1) == graphs.shape_for(3, 3, 1) == CudaGraphShape(8, 8, 1)
    assert graphs.shape_for(1, 20, 20) == CudaGraphShape(32, 4, 32)  # padded to 32 tokens, a dummy prompt in slot 4
    assert graphs.shape_for(4, 20, 9) == CudaGraphShape(32, 16, 32)  # no slot left for the padding in (32, 4)
    assert graphs.shape_for(16, 32, 2) == CudaGraphShape(64, 32, 64)  # neither (32, 16) nor (64, 16) has a slot to spare
    assert graphs.shape_for(2, 65, 64) == CudaGraphShape(100, 4, 100)
    assert graphs.shape_for(2, 101, 100) is None and graphs.shape_for(65, 65, 1) is None
    # Mixed graphs reach the token budget whatever the longest request; the query bound they are
    # captured with does not exceed it.
    shapes = cudagraph_capture_shapes(max_num_seqs=64, max_num_batched_tokens=1000, max_model_len=40)
    largest = max(s for s in shapes if not s.uniform_decode)
    assert largest.num_tokens == 1000 and largest.max_query_len == 40
    assert {s.max_query_len for s in shapes if s.num_tokens == 32 and not s.uniform_decode} == {32}
    # One running request: a slot more for the dummy prompt.
    shapes = cudagraph_capture_shapes(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    assert shapes == [CudaGraphShape(1, 1, 1), CudaGraphShape(32, 2, 32), CudaGraphShape(64, 2, 64)]


def test_graphs_long_enough_for_the_long_query_tiles_come_twice():
    """Where a mixed graph's query bound reaches the backend's long_query_len, a second graph is
    bounded below it: a step of short prompts replays that one (the tiles of short prompts), a step
    with a long prompt the other."""
    shapes = cudagraph_capture_shapes(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=200,
                                      long_query_len=100)
    bounds = {}
    for s in shapes:
        if not s.uniform_decode:
            bounds.setdefault(s.num_tokens, set()).add(s.max_query_len)
    assert bounds == {32: {32}, 64: {64}, 128: {99, 128}, 256: {99, 200}}
    graphs = CudaGraphs()
    graphs.shapes = sorted(shapes)
    assert graphs.shape_for(3, 120, 99) == CudaGraphShape(128, 4, 99)
    assert graphs.shape_for(3, 120, 100) == CudaGraphShape(128, 4, 128)
    assert graphs.shape_for(2, 250, 150) == CudaGraphShape(256, 4, 200)
    assert graphs.shape_for(2, 250, 201) is None  # longer than any graph's bound (and than max_model_len)


def test_a_mixed_step_padded_to_a_graph_shape_computes_the_same_and_pads_write_nowhere(tmp_path, monkeypatch):
    """A decode beside a new prompt (10 tokens, 2 requests), staged as the graph path stages it for a
    captured shape of 32 tokens and 4 request slots, over step buffers left stale by a larger step,
    and run eagerly: the real tokens' hidden states are those of the unpadded step, and the step
    writes exactly the real tokens' KV slots."""
    pytest.importorskip("triton")
    path = make_tiny_model("qwen3", tmp_path)
    with LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton", max_model_len=64,
             max_num_seqs=4) as llm:
        engine = llm.engine
        runner, scheduler = engine.executor.worker.model_runner, engine.scheduler
        layers = runner.model.attention_layers()
        for layer in layers:  # stale values everywhere but the null block
            layer.kv_cache.normal_()
            layer.kv_cache[:, 0].zero_()
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        engine.add_request("0", [1, 2, 3, 4, 5], params)
        scheduler.update_from_output(runner.execute_model(scheduler.schedule()).get_output())
        engine.add_request("1", list(range(10, 19)), params)
        plan = scheduler.schedule()
        assert list(plan.num_scheduled_tokens.values()) == [1, 9]
        runner.update_states(plan)
        before = [layer.kv_cache.clone() for layer in layers]

        unpadded = runner.prepare_inputs(plan)
        assert unpadded.cuda_graph_shape is None
        expected = runner.model(unpadded.input_ids, unpadded.positions, unpadded.attn_metadata).clone()
        real_slots = unpadded.attn_metadata[0].common.slot_mapping.tolist()

        buffers = runner.buffers
        # (32, 4): slot 2 has no query; the dummy prompt in slot 3 takes the 22 padding tokens over
        # the null block. (128, 4): the dummy prompt takes max_model_len (64) of the 118 padding
        # tokens, all its block-table row reaches; the 54 after it belong to no request. (128, 4) bounded
        # at 40, as a graph below a backend's long_query_len: the dummy prompt stops at the bound.
        for shape, max_query_len, query_start_loc, seq_lens in [
            (CudaGraphShape(32, 4, 32), 32, [0, 1, 10, 10, 32], [6, 9, 0, 22]),
            (CudaGraphShape(128, 4, 64), 64, [0, 1, 10, 10, 74], [6, 9, 0, 64]),
            (CudaGraphShape(128, 4, 40), 40, [0, 1, 10, 10, 50], [6, 9, 0, 40]),
        ]:
            for layer, cache in zip(layers, before):
                layer.kv_cache.copy_(cache)
            for buffer, stale in [(buffers.query_start_loc, 7), (buffers.seq_lens, 50), (buffers.input_ids, 5),
                                  (buffers.positions, 9), (buffers.block_tables[0], 3),
                                  (buffers.slot_mappings[0], 70)]:
                buffer.np[:] = stale
            assert shape.fits(2, 10, 9)
            monkeypatch.setattr(runner.cuda_graphs, "shape_for", lambda *step, shape=shape: shape)
            padded = runner.prepare_inputs(plan)
            assert padded.cuda_graph_shape == shape and padded.num_tokens == 10
            common = padded.attn_metadata[0].common
            assert padded.input_ids.shape[0] == shape.num_tokens and common.num_reqs == 4
            assert common.max_query_len == max_query_len
            assert common.query_start_loc.tolist() == query_start_loc and common.seq_lens.tolist() == seq_lens
            assert (common.block_table[3] == 0).all() and (common.slot_mapping[10:] == -1).all()
            hidden = runner.model(padded.input_ids, padded.positions, padded.attn_metadata)

            torch.testing.assert_close(hidden[:10], expected)
            for layer, cache in zip(layers, before):
                written = (layer.kv_cache != cache).flatten(3).any(dim=3).any(dim=0).flatten()  # per slot
                assert torch.nonzero(written).flatten().tolist() == sorted(real_slots)


def test_the_batch_follows_the_plans_through_finishes_joins_and_preemptions(tmp_path):
    """Through requests that finish, join and are preempted, checked after every step: the batch's
    first rows are the step's requests in the plan's order (its cached requests, then its new
    ones); each row holds exactly the tokens the scheduler had when it planned (the plans'
    new_token_ids), the newest token being on the device for the requests that sampled it in the
    step before; the sampling metadata holds the rows' settings, made again only when the rows
    changed; and every row whose step reaches its last known token samples, the others (prompt
    chunks) do not."""
    path = make_tiny_model("qwen3", tmp_path)
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=3,
              max_num_batched_tokens=16, block_size=4, num_blocks=14)
    engine = llm.engine
    runner, scheduler = engine.executor.worker.model_runner, engine.scheduler
    execute, refresh, log = runner.execute_model, runner.input_batch.refresh_sampling_metadata, Counter()

    def counted_refresh():
        log["metadata made"] += 1
        refresh()

    def checked_execute(plan):
        log["steps"] += 1
        log["preempted"] += len(plan.preempted_req_ids)
        requests = [scheduler.requests[req_id] for req_id in plan.num_scheduled_tokens]
        known = {r.request_id: list(r.all_token_ids) for r in requests}
        # The scheduler counts a placeholder for the token a step samples: the step's is the last.
        samples = {r.request_id: 0 < r.num_output_placeholders == r.num_computed_tokens - r.num_tokens + 1
                   for r in requests}
        on_device = set(runner.prev_req_id_to_index)
        output = execute(plan)
        batch = runner.input_batch
        step = [*plan.scheduled_cached_reqs.req_ids, *(new.req_id for new in plan.scheduled_new_reqs)]
        assert batch.req_ids[: batch.num_reqs] == step and set(batch.req_ids[len(step):]).isdisjoint(step)
        for row, req_id in enumerate(step):
            assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == known[req_id]
            num_after_step = batch.num_computed_tokens[row] + plan.num_scheduled_tokens[req_id]
            assert num_after_step <= len(known[req_id]) + (req_id in on_device)  # at most the device's token more
        if step:
            temperatures = [scheduler.requests[req_id].sampling_params.temperature for req_id in step]
            assert batch.sampling_metadata.temperature.tolist() == pytest.approx(temperatures)
            sampled = output.get_output()
            assert sampled.req_ids == step
            assert {req_id: bool(tokens) for req_id, tokens in zip(step, sampled.sampled_token_ids)} == samples
        return output

    runner.execute_model = checked_execute
    runner.input_batch.refresh_sampling_metadata = counted_refresh
    prompts = [[(i * 13 + j * 5) % 250 for j in range(6 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 5 * i, temperature=0.1 * i, ignore_eos=True,
                             prompt_logprobs=1 if i % 3 == 1 else None) for i in range(6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    # vLLM's layout: None for the first prompt token, then one entry per prompt token.
    assert [len(o.prompt_logprobs or ()) for o in outputs] == [len(p) * (i % 3 == 1) for i, p in enumerate(prompts)]
    assert log["preempted"] and log["steps"] > 2 * log["metadata made"] > 0


def test_the_kv_cache_sizing_leaves_room_for_what_the_runner_allocates_on_demand(monkeypatch):
    """On CUDA the KV cache takes what is left of the engine's share after the memory in use, the
    profiling run's peak and the runner's on-demand memory (the penalties' token counts, allocated
    for the first request with penalties): the sizing's arithmetic, with CUDA's memory queries
    faked, and the token counts' size against what they allocate."""
    from types import SimpleNamespace

    from micro_vllm.config import CacheConfig
    from micro_vllm.worker import worker as worker_module
    from micro_vllm.worker.input_batch import TokenCounts
    from micro_vllm.worker.model_runner import ModelRunner

    counts = TokenCounts(3, 50, torch.device("cpu"))
    assert TokenCounts.nbytes(3, 50) == sum(t.numel() * t.element_size() for t in vars(counts).values()
                                            if isinstance(t, torch.Tensor))
    gib = 2**30
    allocated = iter([2 * gib, 5 * gib])  # before the profiling run, and at its peak
    for name, value in {"empty_cache": lambda: None, "reset_peak_memory_stats": lambda: None,
                        "synchronize": lambda: None, "memory_allocated": lambda: next(allocated),
                        "max_memory_allocated": lambda: next(allocated),
                        "mem_get_info": lambda: (70 * gib, 80 * gib)}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(worker_module, "profile_run", lambda runner: None)
    runner = SimpleNamespace(kv_cache_bytes_per_block=lambda: gib // 4, vocab_size=151_936,
                             settings=SimpleNamespace(max_num_seqs=1024))
    runner.on_demand_bytes = lambda: ModelRunner.on_demand_bytes(runner)
    worker = SimpleNamespace(config=SimpleNamespace(cache_config=CacheConfig(gpu_memory_utilization=0.5)),
                             settings=SimpleNamespace(device=torch.device("cuda")), model_runner=runner)
    # 40 GiB of the 80, less the 10 in use, the 3 of the peak and the token counts' 0.72 GiB.
    on_demand = 1024 * 151_936 * 5
    assert worker_module.Worker.determine_num_blocks(worker, 8) == int((27 * gib - on_demand) // (gib // 4)) == 105
