"""Time the Triton attention kernel under several tile shapes, on the benchmark model's shapes.

    python benchmarks/attention_sweep.py [--json results.jsonl]

Decode batches of 256 down to 8 requests (one query each; the recipe's full batch with contexts of
100 to 2,047 tokens, and the smaller batches of its long tail, whose contexts are longer), each under
the tile shape in use and the double-buffered shapes, with pages of 16 and 32 tokens laid out as the
runner does (a page holds token after token, each token its KV heads side by side) and head-major
(a page holds each KV head's tokens together, so a program reads one contiguous run per page; the
kernel reads the cache through its strides, so only the view differs); the batches of 64 or fewer
under every split count (flash-decoding programs per request and KV head; "auto" is the backend's own
choice); and a prefill step (16 prompts of 1,024 tokens beside 64 decodes) under every prefill tile
shape. Decode batches come in the runner's order (``decode_order``, longest context first).
Qwen3-0.6B's attention: 16 query heads, 8 KV heads of 128, bf16, pages in random order. Each tile
shape is checked against the backend's own choice (same outputs up to bf16 rounding) and timed as
CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), as the engine runs decodes: timed
as eager calls, batches of 64 requests or fewer measured the host's launch overhead (2026-11-29).
Decode reports K/V read in TB/s, prefill TFLOP/s.
``tests/hopper_compile.py`` reports each shape's registers and spills without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import torch

from micro_vllm.attention.attention import AttentionMetadata
from micro_vllm.attention.operators import triton_attn

Tiles = triton_attn._Tiles
# Five stages are the fewest at which the compiler keeps two K and two V buffers (the block-table load
# takes a stage of its own; tests/hopper_compile.py's machinery, 2026-11-29): loads stay in flight while
# a program computes, which matters most where few programs share an SM.
DOUBLE_BUFFERED = [Tiles(16, 128, 4, 5, True), Tiles(16, 64, 4, 5, True)]
# Other decode shapes (16 x 64 and 16 x 32 keys, 8 warps) were 13 to 20% slower at 256 requests
# (commit e1cdfbb, docs/benchmarks.md).
DECODE_TILES = [Tiles(16, 128, 4, 3, True), *DOUBLE_BUFFERED]
PREFILL_TILES = [Tiles(64, 64, 4, 2, False), Tiles(64, 32, 4, 2, False), Tiles(64, 32, 4, 3, False),
                 Tiles(64, 16, 4, 2, False), Tiles(32, 32, 4, 2, False), Tiles(32, 64, 4, 2, False),
                 Tiles(128, 32, 8, 2, False), Tiles(128, 32, 4, 2, False), Tiles(128, 64, 8, 3, False),
                 Tiles(64, 64, 4, 3, False)]
# Slower on the prefill step of main(): 64 x 64 with 8 warps (94 TFLOP/s against 172 for the shape in
# use) and 128 x 64 with 8 warps and 2 stages (128), commit fd52638.
SPLITS = [None, 1, 2, 4, 8]  # 16 lost at every batch size timed (8 to 128 requests, 2026-11-29)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 8, 128
LAYOUTS = ("tokens", "heads")  # within a page: token-major (the runner's) or KV-head-major


def make_step(query_lens: list[int], context_lens: list[int], device: str, dtype=torch.bfloat16, seed: int = 0,
              block_size: int = 16, layout: str = "tokens"):
    """A step's query, paged K/V cache and metadata: request i has ``context_lens[i]`` cached tokens
    and ``query_lens[i]`` new ones, its pages scattered over the cache. The cache is always indexed
    [K/V, page, token, KV head, dim]; with ``layout="heads"`` it is a view of memory ordered
    [K/V, page, KV head, token, dim]."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    pages_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_req) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays the null block
    table = torch.zeros(len(seq_lens), max(pages_per_req), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages_per_req):
        table[i, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    if layout == "heads":
        kv_cache = kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device), seq_lens=seq_lens_t.to(device), block_table=table.to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_t,
    )
    return query.to(device), kv_cache.to(device), metadata


def attend(step, tiles: Tiles | None, num_splits: int | None = None) -> torch.Tensor:
    """The backend's forward with ``tiles`` and ``num_splits`` forced (None: the backend's choice)."""
    query, kv_cache, metadata = step
    pick, splits = triton_attn._pick_tiles, triton_attn._num_splits
    if tiles is not None:
        triton_attn._pick_tiles = lambda *args: tiles
    if num_splits is not None:
        triton_attn._num_splits = lambda *args: num_splits
    try:
        return triton_attn.TritonBackend().forward(query, kv_cache, metadata, scale=HEAD_SIZE**-0.5,
                                                   sliding_window=None)
    finally:
        triton_attn._pick_tiles, triton_attn._num_splits = pick, splits


def sweep(name: str, step, tile_list: list[Tiles], work: float, unit: str, split_list=(None,)) -> list[dict]:
    """Check and time each tile shape and split count; ``work`` is what one call does (bytes or
    FLOPs), reported per second in units of 10^12 (``unit``)."""
    from triton.testing import do_bench_cudagraph

    expected = attend(step, None).float()
    rows = []
    for tiles in tile_list:
        for num_splits in split_list:
            error = (attend(step, tiles, num_splits).float() - expected).abs().max().item()
            ms = do_bench_cudagraph(lambda: attend(step, tiles, num_splits), rep=200, return_mode="median")
            rate = work / (ms * 1e-3) / 1e12
            rows.append({"batch": name, "tiles": tiles._asdict(), "splits": num_splits, "ms": ms, unit: rate,
                         "max_abs_diff": error})
            print(f"{name:24s} rows {tiles.block_m:3d} keys {tiles.tile_n:3d} warps {tiles.num_warps} stages "
                  f"{tiles.num_stages} splits {num_splits or 'auto'}: {1000 * ms:8.1f} us  {rate:7.2f} {unit}  "
                  f"max |diff| {error:.1e}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    parser.add_argument("--part", choices=("all", "decode", "prefill"), default="all")
    args = parser.parse_args()
    rng = random.Random(0)

    rows = []
    decode_batches = ((256, 100), (128, 500), (64, 800), (32, 800), (16, 800), (8, 800))
    for num_reqs, shortest in decode_batches if args.part != "prefill" else ():
        contexts = [rng.randint(shortest, 2047) for _ in range(num_reqs)]
        kv_bytes = sum(c + 1 for c in contexts) * NUM_KV_HEADS * HEAD_SIZE * 2 * 2  # K and V, bf16
        for block_size in (16, 32):
            for layout in LAYOUTS:
                query, kv_cache, metadata = make_step([1] * num_reqs, contexts, "cuda", block_size=block_size,
                                                      layout=layout)
                order = torch.argsort(-metadata.seq_lens.long(), stable=True).to(torch.int32)  # as the runner
                decode = (query, kv_cache, dataclasses.replace(metadata, decode_order=order))
                name = f"decode {num_reqs} {layout} {block_size}"
                # Splits only where (request, KV head) pairs alone leave SMs idle: with 128 requests
                # or more two splits were slower or within 1.1% (e1cdfbb).
                splits = SPLITS if num_reqs <= 64 and (block_size, layout) == (16, "tokens") else (None,)
                rows += sweep(name, decode, DECODE_TILES[:1], kv_bytes, "TB/s", splits)
                rows += sweep(name, decode, DOUBLE_BUFFERED, kv_bytes, "TB/s")
                del query, kv_cache, metadata, decode

    if args.part != "decode":
        query_lens = [1024] * 16 + [1] * 64
        context_lens = [0] * 16 + [rng.randint(100, 2047) for _ in range(64)]
        prefill = make_step(query_lens, context_lens, "cuda", seed=1)
        # QK^T and PV over the causal half of each prompt, every query head: 2 * 2 * D FLOPs per pair.
        pairs = sum(q * (q + 1) // 2 + q * c for q, c in zip(query_lens, context_lens))
        rows += sweep("prefill", prefill, PREFILL_TILES, 4 * HEAD_SIZE * NUM_HEADS * pairs, "TFLOP/s")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "attention_sweep", "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
