"""Compile every Triton kernel launch of micro-vLLM for the H200 (sm_90) on a machine without a GPU.

Run as a script, with TRITON_INTERPRET unset. The real launch wrappers (``triton_attn``,
``triton_ops``, the sampling's) are called on CPU tensors shaped like the benchmark model's (Qwen3-0.6B: 16 query
heads, 8 KV heads of 128), like a sliding-window model and with head sizes of 12, 80 and 256, in bf16 (and fp32 for attention). Each kernel launch is
caught instead of run, and its arguments become an ahead-of-time compile with Triton's own ptxas:
what the interpreter accepts but the GPU compiler rejects, a tile that needs more shared memory than
an H200 block has, or a bf16/fp16 kernel that spills registers, fails here, not on the GPU machine.
Prints one line per compiled variant (shared memory, registers, stack frame); exits non-zero on the
first failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET: kernels must be compiled"

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from micro_vllm.attention.backends import triton_attn  # noqa: E402
from micro_vllm.attention.backends.abstract import CommonAttentionMetadata  # noqa: E402
from micro_vllm.attention.spec import AttentionSpec  # noqa: E402
from micro_vllm.layers import triton_ops  # noqa: E402
from micro_vllm.sampling import triton_penalties, triton_sampler, triton_top_k_top_p, triton_top_p  # noqa: E402
from micro_vllm.sampling.logits_processors import Penalties  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
MAX_SHARED_MEMORY = 232_448  # bytes a block may use on sm_90 (227 KiB)
MAX_STACK_BYTES = 64  # a few bytes of stack frame are not spills (the decode kernel has 8)
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")
# Constexprs the wrappers derive from the tensors' device: the values a CUDA launch passes.
ON_CUDA = {"MEAN_BY_DIVISION": False}
compiled: set[tuple] = set()


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict) -> None:
    """Compile one launch as ``kernel[grid](*args, **kwargs)`` would on the GPU, with the same
    specialisation of the arguments: an int equal to 1 becomes a constant, ints that are multiples
    of 16 and 16-byte aligned pointers are marked divisible by 16 (what lets Triton vectorise loads)."""
    bound = dict(zip(kernel.arg_names, args), **{k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", ON_CUDA.get(param.name, value)
            continue
        kind, attr = native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = attr
        elif attr:
            attrs[(index,)] = BaseBackend.parse_attr(attr)
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    key = (kernel.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())), str(attrs),
           tuple(sorted(options.items())))
    if key in compiled:
        return
    binary = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=H200, options=options)
    shared = binary.metadata.shared
    if shared > MAX_SHARED_MEMORY:
        raise RuntimeError(f"{kernel.__name__} {constexprs} needs {shared} bytes of shared memory; sm_90 has {MAX_SHARED_MEMORY}")
    usage = resource_usage(binary)
    # Spills are invisible on CPU and slow on the GPU: bf16/fp16 kernels must not spill (fp32
    # variants, which only the GPU correctness tests run, may).
    stack = re.search(r"STACK:(\d+)", usage)
    low_precision = any(kind in ("*bf16", "*fp16") for kind in signature.values())
    if low_precision and stack and int(stack.group(1)) > MAX_STACK_BYTES:
        raise RuntimeError(f"{kernel.__name__} {constexprs} spills: {usage}")
    compiled.add(key)
    print(f"ok {kernel.__name__} {constexprs} {options}: {shared} bytes of shared memory, {usage}", flush=True)


def resource_usage(binary) -> str:
    """Registers and stack frame per thread (a stack frame means spills), from the cuobjdump that
    Triton's package carries."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return "no cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True, text=True)
    fields = [line.split("CONSTANT")[0].strip() for line in report.stdout.splitlines() if "REG:" in line]
    return fields[0] if fields else "no resource report"


def catch_launches() -> None:
    """``kernel[grid](...)`` compiles for the H200 instead of running."""
    JITFunction.__getitem__ = lambda kernel, grid: (lambda *args, **kwargs: compile_launch(kernel, args, kwargs))


def attention_launches(dtype: torch.dtype, group: int, window: int | None, num_splits: int,
                       head_size: int = 128, kv_cache_dtype: torch.dtype | None = None) -> None:
    backend = triton_attn.TritonBackend()
    num_kv_heads, block_size, num_blocks, max_num_reqs = 8, 16, 64, 12
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=kv_cache_dtype or dtype)
    builder = triton_attn.TritonAttentionMetadataBuilder(
        AttentionSpec(num_kv_heads, head_size, window), group * num_kv_heads, block_size, max_num_reqs,
        torch.device("cpu"), kv_cache.dtype, dtype,
    )
    # A decode batch (decode tiles), a step of short chunks (decode tiles on a prefill step's path),
    # a mixed one (prefill tiles), one with a long prompt (long-prefill tiles).
    for query_lens in ([1] * 12, [16 // group, 1, 1], [300, 1, 1, 7], [triton_attn._LONG_QUERY, 1]):
        num_reqs, num_tokens = len(query_lens), sum(query_lens)
        seq_lens = torch.tensor([n + 40 for n in query_lens], dtype=torch.int32)
        query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
        splits = num_splits if max(query_lens) == 1 else 1
        triton_attn._num_splits = lambda *_, n=splits: n
        # As the runner builds it: decode steps ordered longest context first.
        metadata = builder.build(CommonAttentionMetadata(
            num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table=torch.zeros(num_reqs, 256, dtype=torch.int32),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
        ))
        qkv = torch.zeros(num_tokens, (group + 2) * num_kv_heads * head_size, dtype=dtype)
        query = qkv[:, : group * num_kv_heads * head_size].view(num_tokens, group * num_kv_heads, head_size)
        key, value = (qkv[:, (group + i) * num_kv_heads * head_size:][:, : num_kv_heads * head_size]
                      .view(num_tokens, num_kv_heads, head_size) for i in (0, 1))
        # As a layer runs it: the decode batch stores its K/V inside the attention launch, the mixed
        # one launches the write kernel first.
        # Distinct K and V tensors: the compiler would share one buffer between loads of one tensor.
        backend.write_and_attend(query, key, value, kv_cache, metadata, scale=head_size**-0.5, sliding_window=window)


def layer_launches(dtype: torch.dtype, hidden: int = 1024, heads: int = 16, kv_heads: int = 8, head_size: int = 128,
                   intermediate: int = 3072) -> None:
    num_tokens = 10
    x = torch.zeros(num_tokens, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    triton_ops.rms_norm(x, weight, 1e-6)
    triton_ops.rms_norm(x, weight, 1e-6, residual=x)
    qkv = torch.zeros(num_tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q = qkv[:, : heads * head_size]
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    cos_sin = torch.zeros(4096, head_size, dtype=torch.float32)
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    head_norm = (torch.ones(head_size, dtype=dtype), 1e-6)
    triton_ops.qk_norm(q, k, head_norm, head_norm, head_size)  # Qwen3's
    triton_ops.rotary_embedding(positions, q, k, cos_sin, head_size)
    triton_ops.fused_qk_norm_rope(positions, q, k, head_norm, head_norm, cos_sin, head_size)  # Qwen3's, fused
    triton_ops.silu_and_mul(torch.zeros(num_tokens, 2 * intermediate, dtype=dtype))


def main() -> int:
    catch_launches()
    layer_launches(torch.bfloat16)
    # Widths that are no power of two, padded inside the kernels: hidden 576 (SmolLM2-135M), head 80.
    layer_launches(torch.bfloat16, hidden=576, heads=9, kv_heads=3, head_size=80, intermediate=1536)
    for group, window, num_splits in ((2, None, 1), (2, None, 4), (4, 256, 1)):
        attention_launches(torch.bfloat16, group, window, num_splits)
    # Padded heads (12 to 16 lanes, 80 to 128) and the widest served (256: decode takes 64-key tiles).
    for head_size, num_splits in ((12, 1), (80, 4), (256, 1)):
        attention_launches(torch.bfloat16, 2, None, num_splits, head_size=head_size)
    attention_launches(torch.float32, 2, None, 1)  # fp32 dots ("ieee") take another code path
    for head_size, num_splits in ((128, 1), (128, 4), (256, 1)):  # kv_cache_dtype="fp8": unsplit decodes capped
        attention_launches(torch.bfloat16, 2, None, num_splits, head_size=head_size, kv_cache_dtype=torch.float8_e4m3fn)
    for dtype in (torch.bfloat16, torch.float32):  # the logits' dtype (fp32: scaled by the Sampler for top-k)
        for threshold in (None, torch.zeros(4, 1)):  # without a filter, and with top-k / top-p
            triton_sampler.sample(torch.zeros(4, 151936, dtype=dtype), torch.ones(4), torch.zeros(4, dtype=torch.int64),
                                  threshold)
    # Top-p alone on the model's logits with their inverse temperatures; beside top-k, on the scaled ones.
    triton_top_p.top_p_threshold(torch.zeros(4, 151936, dtype=torch.bfloat16), torch.full((4,), 0.9), torch.ones(4))
    triton_top_p.top_p_threshold(torch.zeros(4, 151936), torch.full((4,), 0.9))
    # Top-k with top-p, from 64 candidates: on the model's logits with their inverse temperatures, and
    # on fp32 ones the Sampler scaled.
    top_k, top_p = torch.full((4,), 50, dtype=torch.int32), torch.full((4,), 0.9)
    for dtype, inverse_temperature in ((torch.bfloat16, torch.ones(4)), (torch.float32, None)):
        logits = torch.zeros(4, 151936, dtype=dtype)
        candidates = torch.zeros(4, 64, dtype=dtype)
        triton_top_k_top_p.top_k_top_p_threshold(candidates, logits, top_k, top_p, inverse_temperature)
    # The penalties, from the model's logits and from fp32 ones the other processors made, with each
    # row's settings as the runner passes them: the rows of one tensor, 16-byte aligned for a batch of
    # 4 rows and not for one of 5. One variant per logits dtype, whatever the alignment.
    vocab = 151936
    counts, prompt_mask = torch.zeros(8, vocab, dtype=torch.int32), torch.zeros(8, vocab, dtype=torch.bool)
    for num_rows in (4, 5):
        presence, frequency, repetition = torch.ones(3, num_rows)
        penalties = Penalties(presence, frequency, repetition, counts, prompt_mask)
        for dtype in (torch.bfloat16, torch.float32):
            triton_penalties.apply_penalties(torch.zeros(num_rows, vocab, dtype=dtype), penalties)
    penalty_variants = sum(key[0] == "_penalties_kernel" for key in compiled)
    if penalty_variants != 2:
        raise RuntimeError(f"the penalties pass compiled {penalty_variants} variants; one per logits dtype is 2")
    print(f"{len(compiled)} kernel variants compiled for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
