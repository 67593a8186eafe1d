"""Time the Triton attention kernel under several tile shapes, on the benchmark model's shapes.

    python benchmarks/attention_sweep.py [--json results.jsonl] [--part decode] [--kv-cache-dtype fp8]
        [--decode-tiles 128x4x3,64x2x3,128x4x3x168] [--decode-batches 20x8000-8511,32x800-2047]

Decode batches of 256 down to 8 requests (one query each; the recipe's full batch with contexts of 100
to 2,047 tokens, the smaller batches of its long tail, whose contexts are longer, and the long-context
workload's 32 requests of 8,000 to 8,511 tokens; or those of ``--decode-batches``) under the decode
tiles in use (or those of ``--decode-tiles``, with a cap on an unsplit program's registers as a fourth
number), timed as layers run them (``write_and_attend``: the new keys join in the attention launch), the
batches of 64 or fewer under every split count too (flash-decoding programs per request and KV head;
"auto" is the backend's own choice); and a prefill step (16 prompts of 1,024 tokens beside 64 decodes)
under every prefill tile shape, attention alone, then steps of prompts alone of 512 to 8,000 tokens
under the prefill, long-prefill and fp8 tiles. Decode batches come in the runner's order
(``decode_order``, longest context first). Qwen3-0.6B's attention: 16 query heads, 8 KV heads of 128,
bf16, pages in random order. Each tile shape is checked against the backend's own choice (same outputs
up to bf16 rounding) and timed as CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), as
the engine runs decodes: timed as eager calls, batches of 64 requests or fewer measure the host's launch
overhead. Decode reports K/V read in TB/s, prefill TFLOP/s. ``--kv-cache-dtype fp8`` stores the cache in
float8 e4m3 (as ``kv_cache_dtype="fp8"`` does), so decode reads half the bytes.
``tests/helpers/hopper_compile.py`` reports each shape's registers and spills without a GPU.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from micro_vllm.attention.backends import triton_attn
from micro_vllm.attention.backends.abstract import CommonAttentionMetadata, to_cache_dtype
from micro_vllm.attention.spec import AttentionSpec

Tiles = triton_attn._Tiles
PREFILL_TILES = [Tiles(64, 32, 4, 2, False), Tiles(64, 64, 4, 2, False), Tiles(64, 32, 4, 3, False),
                 Tiles(64, 16, 4, 2, False), Tiles(32, 32, 4, 2, False), Tiles(32, 64, 4, 2, False),
                 Tiles(128, 32, 8, 2, False), Tiles(128, 32, 4, 2, False), Tiles(128, 64, 8, 3, False),
                 Tiles(64, 64, 4, 3, False)]
# Left out, as slower on the prefill step of main(): 64 x 64 with 8 warps (about half the rate of 64 x 64
# with 4) and 128 x 64 with 8 warps and 2 stages.
# Steps of prompts alone, from the recipe's lengths to the long-context workload's, under the prefill
# tiles, the long-prefill ones and an fp8 cache's: where the long-prefill tiles start to win decides
# triton_attn._LONG_QUERY.
LONG_PREFILL_STEPS = ((16, 512), (8, 1024), (4, 2048), (2, 4096), (1, 8000), (2, 8000))
# The last two read the step's own K/V through TMA descriptors, as the long tiles in use do.
LONG_PREFILL_TILES = [Tiles(64, 32, 4, 2, False), Tiles(64, 64, 4, 2, False), Tiles(128, 64, 8, 3, False),
                      Tiles(128, 64, 8, 2, False), Tiles(128, 128, 8, 2, False), Tiles(128, 32, 8, 2, False),
                      Tiles(128, 64, 8, 3, False, True), Tiles(128, 128, 8, 3, False, True)]
SPLITS = [None, 1, 2, 3, 4, 6, 8]  # 16 splits were slower at every batch size from 8 to 128 requests
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 8, 128, 16


def make_step(query_lens: list[int], context_lens: list[int], device: str, dtype=torch.bfloat16, seed: int = 0,
              cache_dtype: torch.dtype | None = None):
    """A step's query, paged K/V cache, common metadata and new K/V rows: request i has
    ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones, its pages scattered over the
    cache, which holds ``cache_dtype`` (default: ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    pages_per_req = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(pages_per_req) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays the null block
    table = torch.zeros(len(seq_lens), max(pages_per_req), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages_per_req):
        table[i, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    kv_cache = to_cache_dtype(torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen),
                              cache_dtype or dtype)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    new_kv = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)  # the step's own K/V
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device), seq_lens=seq_lens_t.to(device), block_table=table.to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_t,
    )
    query, kv_cache, new_kv = query.to(device), kv_cache.to(device), new_kv.to(device)
    if max(query_lens) > 1:  # the rows as the write launch leaves them (an fp8 cache's rounded), timed without it
        triton_attn.TritonBackend().write_kv(*new_kv, kv_cache, common.slot_mapping,
                                             round_rows=kv_cache.element_size() == 1)
    return query, kv_cache, common, new_kv


def plan(step, tiles: Tiles | None, num_splits: int | None = None) -> triton_attn.TritonAttentionMetadata:
    """The step's metadata from the backend's builder (decode steps ordered longest context first,
    as the runner's are), with ``tiles`` and ``num_splits`` forced (None: the builder's choice)."""
    query, kv_cache, common, _ = step
    pick, splits = triton_attn._pick_tiles, triton_attn._num_splits
    if tiles is not None:
        triton_attn._pick_tiles = lambda *args: tiles
    if num_splits is not None:
        triton_attn._num_splits = lambda *args: num_splits
    try:
        builder = triton_attn.TritonAttentionMetadataBuilder(AttentionSpec(NUM_KV_HEADS, HEAD_SIZE), NUM_HEADS,
                                                             BLOCK_SIZE, common.num_reqs, query.device, kv_cache.dtype,
                                                             query.dtype)
        return builder.build(common)
    finally:
        triton_attn._pick_tiles, triton_attn._num_splits = pick, splits


def launch(step, metadata: triton_attn.TritonAttentionMetadata) -> torch.Tensor:
    """The backend's attention as layers run it: a decode step takes its new keys in the attention
    launch (no slot is written: the sweep's slots are all padding); other steps attend with their
    rows at hand (the builder chose whether their keys are read from them), timed without the write
    launch that precedes them."""
    query, kv_cache, _, new_kv = step
    backend = triton_attn.TritonBackend()
    if metadata.write_kv_in_launch:
        return backend.write_and_attend(query, *new_kv, kv_cache, metadata, scale=HEAD_SIZE**-0.5, sliding_window=None)
    return backend._attend(query, *new_kv, kv_cache, metadata, HEAD_SIZE**-0.5, None)


def attend(step, tiles: Tiles | None, num_splits: int | None = None) -> torch.Tensor:
    """``launch`` of the step as ``plan`` builds it with these forced settings."""
    return launch(step, plan(step, tiles, num_splits))


def sweep(name: str, step, tile_list: list[Tiles], work: float, unit: str, split_list=(None,)) -> list[dict]:
    """Check and time each tile shape and split count; ``work`` is what one call does (bytes or
    FLOPs), reported per second in units of 10^12 (``unit``)."""
    from triton.testing import do_bench_cudagraph

    expected = attend(step, None).float()
    rows = []
    for tiles in tile_list:
        for num_splits in split_list:
            metadata = plan(step, tiles, num_splits)  # built once, as the runner builds a step's
            error = (launch(step, metadata).float() - expected).abs().max().item()
            ms = do_bench_cudagraph(lambda: launch(step, metadata), rep=200, return_mode="median")
            rate = work / (ms * 1e-3) / 1e12
            rows.append({"batch": name, "tiles": tiles._asdict(), "splits": num_splits, "ms": ms, unit: rate,
                         "max_abs_diff": error})
            tma = " tma" if tiles.step_kv_tma else ""
            cap = f" registers {tiles.max_registers}" if tiles.max_registers else ""
            print(f"{name:10s} rows {tiles.block_m:3d} keys {tiles.tile_n:3d} warps {tiles.num_warps} stages "
                  f"{tiles.num_stages}{tma}{cap} splits {num_splits or 'auto'}: {1000 * ms:8.1f} us  {rate:7.2f} {unit}  "
                  f"max |diff| {error:.1e}")
    return rows


def decode_tiles(text: str) -> list[Tiles]:
    """``--decode-tiles``: comma-separated KEYSxWARPSxSTAGES[xREGISTERS], each a decode tile of 16
    rows, REGISTERS a cap on an unsplit program's registers a thread."""
    tiles = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not KEYSxWARPSxSTAGES[xREGISTERS] (three or four "
                                             "positive integers, as in 128x4x3 or 128x4x3x168)")
        keys, warps, stages, *registers = map(int, parts)
        tiles.append(Tiles(16, keys, warps, stages, True, max_registers=registers[0] if registers else None))
    return tiles


def decode_batches(text: str) -> list[tuple[int, int, int]]:
    """``--decode-batches``: comma-separated REQUESTSxSHORTEST-LONGEST, each a decode batch whose
    contexts are drawn from [SHORTEST, LONGEST] tokens."""
    batches = []
    for item in text.split(","):
        requests, _, lengths = item.partition("x")
        shortest, _, longest = lengths.partition("-")
        fields = (requests, shortest, longest)
        if not all(f.isdigit() and int(f) > 0 for f in fields) or int(shortest) > int(longest):
            raise argparse.ArgumentTypeError(f"{item!r} is not REQUESTSxSHORTEST-LONGEST (positive integers, "
                                             "SHORTEST <= LONGEST, as in 32x8000-8511)")
        batches.append(tuple(map(int, fields)))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="append the results as one JSON line to this file")
    parser.add_argument("--part", choices=("all", "decode", "prefill"), default="all")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the cache's dtype: auto (the query's, bf16) or fp8 (float8 e4m3)")
    parser.add_argument("--decode-tiles", type=decode_tiles, metavar="KEYSxWARPSxSTAGES[xREGISTERS],...",
                        help="the decode tiles to time (16 rows each), e.g. 128x4x3,64x2x3,128x4x3x168; "
                             "default: the ones in use")
    parser.add_argument("--decode-batches", type=decode_batches, metavar="REQUESTSxSHORTEST-LONGEST,...",
                        help="the decode batches to time, e.g. 20x8000-8511 (20 requests of 8,000 to 8,511 "
                             "tokens); default: the recipe's and the long-context workload's")
    args = parser.parse_args()
    rng = random.Random(0)
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    # In use: narrower key tiles, 8 warps and five stages (where the compiler keeps two K and two V
    # buffers) were slower, other page sizes and layouts no faster (docs/benchmarks.md, "Attention
    # kernel choices").
    tile_list = args.decode_tiles or [triton_attn._pick_tiles(1, NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE,
                                                              fp8_cache=args.kv_cache_dtype == "fp8")]

    rows = []
    # (requests, shortest and longest context): the recipe's batches, then the long-context
    # workload's decodes (benchmarks/workloads.py: 8,000-token prompts, up to 512 tokens out).
    batches = args.decode_batches or [(256, 100, 2047), (128, 500, 2047), (64, 800, 2047), (32, 800, 2047),
                                      (16, 800, 2047), (8, 800, 2047), (32, 8000, 8511)]
    for num_reqs, shortest, longest in batches if args.part != "prefill" else ():
        contexts = [rng.randint(shortest, longest) for _ in range(num_reqs)]
        decode = make_step([1] * num_reqs, contexts, "cuda", cache_dtype=cache_dtype)
        kv_bytes = sum(c + 1 for c in contexts) * NUM_KV_HEADS * HEAD_SIZE * 2 * cache_dtype.itemsize  # K and V
        # Splits only where (request, KV head) pairs alone leave SMs idle: with 128 requests or more
        # two splits were slower or within 1.1%.
        splits = SPLITS if num_reqs <= 64 else (None,)
        name = f"decode {num_reqs}" + (f" of {shortest:,}+" if shortest > 2047 else "")
        rows += sweep(name, decode, tile_list, kv_bytes, "TB/s", splits)

    if args.part != "decode":
        query_lens = [1024] * 16 + [1] * 64
        context_lens = [0] * 16 + [rng.randint(100, 2047) for _ in range(64)]
        prefill = make_step(query_lens, context_lens, "cuda", seed=1, cache_dtype=cache_dtype)
        # QK^T and PV over the causal half of each prompt, every query head: 2 * 2 * D FLOPs per pair.
        pairs = sum(q * (q + 1) // 2 + q * c for q, c in zip(query_lens, context_lens))
        rows += sweep("prefill", prefill, PREFILL_TILES, 4 * HEAD_SIZE * NUM_HEADS * pairs, "TFLOP/s")
        for num_prompts, prompt_len in LONG_PREFILL_STEPS:
            prompts = make_step([prompt_len] * num_prompts, [0] * num_prompts, "cuda", seed=1, cache_dtype=cache_dtype)
            flops = 4 * HEAD_SIZE * NUM_HEADS * num_prompts * prompt_len * (prompt_len + 1) // 2
            rows += sweep(f"prefill {num_prompts} x {prompt_len:,}", prompts, LONG_PREFILL_TILES, flops, "TFLOP/s")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "attention_sweep", "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
