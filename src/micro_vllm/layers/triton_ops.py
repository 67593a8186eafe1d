"""Fused Triton kernels for a decoder layer's elementwise work: RMSNorm (with the residual add),
rotary embedding (with Qwen3's per-head q/k RMSNorm before it), and SiLU-and-mul, one launch each.

Why: in a 256-request decode step on an H200 the unfused PyTorch layers launch about 45 tiny
elementwise and reduction kernels per decoder layer (more than 1,300 per step, about 30% of the
step's GPU time in session 1's profile; docs/benchmarks.md, "How it got here"). Each op here
replaces 2 (SiLU-and-mul) to 16 (rotary embedding) of them: counting the ops each path calls, a
Qwen3 layer goes from 52 such launches to 6 and a Llama layer from 36 to 4. What that saves in time
is measured on the GPU (``benchmarks/throughput.py --no-fused-ops`` against the default; the figures
are in docs/benchmarks.md), not claimed here.

Each kernel is a twin of the PyTorch code in ``norm.py``, ``rotary.py`` and ``activation.py``, not
an approximation of it: PyTorch computes every bf16/fp16 elementwise op in fp32 and rounds the
result to the tensor's dtype, so the kernels compute in fp32 and round (``_round``) at exactly the
points where the PyTorch code ends an op. Launches pass ``enable_fp_fusion=False`` so a product is
rounded before it is added, as it is between two PyTorch kernels. What can still differ is the
order of the fp32 sum in RMSNorm's variance, which may move an output by an ulp.

The layers call these ops for CUDA tensors; the tests call them on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``). CUDA-graph safe: grids and block shapes depend on tensor shapes
only, outputs are allocated by shape, and nothing on the host reads device data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from micro_vllm.triton_interpreter import interpreted


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (nearest even, as PyTorch rounds), returned as fp32.

    Keeping rounded intermediates in fp32 lets every op run in fp32, and a final store to a
    ``DTYPE`` pointer is then exact.
    """
    if DTYPE == tl.float32:
        y = x
    elif _INTERPRETED and DTYPE == tl.bfloat16:
        # Triton 3.6's interpreter truncates fp32 -> bf16 (and its "rtne" mode rounds ties away from
        # zero): round on the bits. Overflows to inf as it should; NaN is not expected here.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _inv_rms(sum_sq, eps, N: tl.constexpr, MEAN_BY_DIVISION: tl.constexpr):
    """``1 / sqrt(sum_sq / N + eps)`` with the mean PyTorch's RMSNorm computes on each device."""
    if MEAN_BY_DIVISION:
        variance = sum_sq / N  # PyTorch's CPU mean: the sum divided by N
    else:
        variance = sum_sq * (1.0 / N)  # its CUDA mean: the sum times an fp32 factor 1 / N
    return tl.math.rsqrt(variance + eps)


@triton.jit
def _exp(x):
    if _INTERPRETED:
        y = tl.exp(x)  # libdevice is device code, which the interpreter cannot call
    else:
        y = libdevice.exp(x)  # expf, as PyTorch's CUDA kernels use; tl.exp is a faster approximation
    return y


# Read by the jitted helpers above when they are compiled or interpreted, so defined after them.
_INTERPRETED = tl.constexpr(interpreted(_round))


# --- RMSNorm ----------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [A, B, N] contiguous, dtype of weight * x
    residual_out_ptr,  # [A, B, N] contiguous, x's dtype (only with HAS_RESIDUAL)
    x_ptr,
    residual_ptr,
    weight_ptr,
    x_stride_a,
    x_stride_b,
    residual_stride_a,
    residual_stride_b,
    num_b,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,  # N rounded up to a power of two
    ROWS: tl.constexpr,  # rows of the B dimension per program
    HAS_RESIDUAL: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_valid = cols < N
    mask = (rows < num_b)[:, None] & col_valid[None, :]
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + a * x_stride_a + rows[:, None] * x_stride_b + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    out_offset = (a * num_b + rows[:, None]) * N + cols[None, :]
    if HAS_RESIDUAL:
        residual_offset = a * residual_stride_a + rows[:, None] * residual_stride_b + cols[None, :]
        residual = tl.load(residual_ptr + residual_offset, mask=mask, other=0.0)
        x = _round(x + residual.to(tl.float32), dtype)
        tl.store(residual_out_ptr + out_offset, x.to(dtype), mask=mask)

    inv_rms = _inv_rms(tl.sum(x * x, axis=1), eps, N, MEAN_BY_DIVISION)
    normalized = _round(x * inv_rms[:, None], dtype)
    weight = tl.load(weight_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
    out = _round(normalized * weight[None, :], out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [A, B, N] with unit stride along N, without copying 2-D and 3-D inputs.

    3-D covers per-head q/k norm on strided views of the fused qkv output ([tokens, heads, head_size]
    with a token stride wider than heads * head_size).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


def _num_warps(elements: int) -> int:
    # About 256 elements per warp (8 per thread) up to 8 warps: enough loads in flight for these
    # memory-bound kernels without spilling on wide rows.
    return min(max(elements // 256, 1), 8)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension; with ``residual``, of ``x + residual``, returning
    ``(normalized, x + residual)`` as ``RMSNorm.forward`` does. Outputs are new contiguous tensors."""
    rows = _as_rows(x)
    num_a, num_b, hidden = rows.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(out, dtype=x.dtype) if residual is not None else out
    if out.numel() > 0:
        residual_rows = rows if residual is None else _as_rows(residual)
        block_n = triton.next_power_of_2(hidden)
        block_rows = min(triton.next_power_of_2(num_b), max(4096 // block_n, 1))
        _rms_norm_kernel[(num_a, triton.cdiv(num_b, block_rows))](
            out,
            residual_out,
            rows,
            residual_rows,
            weight,
            rows.stride(0),
            rows.stride(1),
            residual_rows.stride(0),
            residual_rows.stride(1),
            num_b,
            eps,
            N=hidden,
            BLOCK_N=block_n,
            ROWS=block_rows,
            HAS_RESIDUAL=residual is not None,
            MEAN_BY_DIVISION=x.device.type == "cpu",
            num_warps=_num_warps(block_rows * block_n),
            enable_fp_fusion=False,
        )
    return out if residual is None else (out, residual_out)


# --- rotary embedding -------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    src_row,
    dst_row,
    cos,
    sin,
    norm_weight_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    """Rotates all heads of one token: channel i pairs with channel i + HEAD_SIZE / 2. With
    HAS_NORM, RMSNorm each head first (Qwen3's q/k norm), rounded as ``_rms_norm_kernel`` rounds."""
    half: tl.constexpr = HEAD_SIZE // 2
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < half)
    offset = heads * HEAD_SIZE + dims
    dtype = dst_row.dtype.element_ty
    first = tl.load(src_row + offset, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src_row + offset + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)
        inv_rms = _inv_rms(sum_sq, eps, HEAD_SIZE, MEAN_BY_DIVISION)[:, None]
        weight_first = tl.load(norm_weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        weight_second = tl.load(norm_weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        first = _round(_round(first * inv_rms, dtype) * weight_first, dtype)
        second = _round(_round(second * inv_rms, dtype) * weight_second, dtype)
    # Each product and each sum is its own rounded op in the PyTorch code.
    new_first = _round(_round(first * cos, dtype) - _round(second * sin, dtype), dtype)
    new_second = _round(_round(second * cos, dtype) + _round(first * sin, dtype), dtype)
    tl.store(dst_row + offset, new_first.to(dtype), mask=mask)
    tl.store(dst_row + offset + half, new_second.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_out_ptr,  # [T, NUM_Q_HEADS * HEAD_SIZE] contiguous
    key_out_ptr,  # [T, NUM_K_HEADS * HEAD_SIZE] contiguous
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_sin_ptr,  # [max_position, HEAD_SIZE]: cos in the first half, sin in the second
    q_norm_weight_ptr,  # [HEAD_SIZE] (only with HAS_NORM)
    k_norm_weight_ptr,
    q_eps,
    k_eps,
    query_stride,
    key_stride,
    cos_sin_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half: tl.constexpr = HEAD_SIZE // 2
    dims = tl.arange(0, HALF_PAD)[None, :]
    cos_sin_row = cos_sin_ptr + position * cos_sin_stride
    # The cache is fp32; PyTorch casts cos and sin to the query's dtype before using them.
    dtype = query_ptr.dtype.element_ty
    cos = _round(tl.load(cos_sin_row + dims, mask=dims < half, other=0.0).to(tl.float32), dtype)
    sin = _round(tl.load(cos_sin_row + half + dims, mask=dims < half, other=0.0).to(tl.float32), dtype)
    _rotate_heads(
        query_ptr + token * query_stride,
        query_out_ptr + token * (NUM_Q_HEADS * HEAD_SIZE),
        cos, sin, q_norm_weight_ptr, q_eps, NUM_Q_HEADS, Q_HEADS_PAD, HEAD_SIZE, HALF_PAD, HAS_NORM, MEAN_BY_DIVISION,
    )
    _rotate_heads(
        key_ptr + token * key_stride,
        key_out_ptr + token * (NUM_K_HEADS * HEAD_SIZE),
        cos, sin, k_norm_weight_ptr, k_eps, NUM_K_HEADS, K_HEADS_PAD, HEAD_SIZE, HALF_PAD, HAS_NORM, MEAN_BY_DIVISION,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates flat ``query`` [T, H * D] and ``key`` [T, Hkv * D] by their tokens' positions; with
    ``norms`` (the query's and the key's RMSNorm weight and eps), RMSNorm each head first.

    The inputs may be column slices of one fused qkv tensor (any row stride). Out of place, as the
    PyTorch path is, so the two paths have one contract: new contiguous tensors, inputs untouched.
    """
    if query.dtype != key.dtype:
        raise ValueError(f"query and key must share a dtype, got {query.dtype} and {key.dtype}")
    if norms is not None and any(weight.dtype != query.dtype for (weight, _) in norms):
        raise ValueError(f"the q/k norm weights must have the query's dtype {query.dtype}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    positions = positions.contiguous()  # a no-op for the runner's positions
    num_tokens = query.shape[0]
    num_q_heads, num_k_heads = query.shape[1] // head_size, key.shape[1] // head_size
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    (q_weight, q_eps), (k_weight, k_eps) = norms or ((query, 0.0), (key, 0.0))  # unread without norms
    if num_tokens > 0:
        q_heads_pad, half_pad = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(head_size // 2)
        _rotary_kernel[(num_tokens,)](
            query_out,
            key_out,
            query,
            key,
            positions,
            cos_sin_cache,
            q_weight,
            k_weight,
            q_eps,
            k_eps,
            query.stride(0),
            key.stride(0),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads,
            NUM_K_HEADS=num_k_heads,
            Q_HEADS_PAD=q_heads_pad,
            K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
            HEAD_SIZE=head_size,
            HALF_PAD=half_pad,
            HAS_NORM=norms is not None,
            MEAN_BY_DIVISION=query.device.type == "cpu",
            num_warps=_num_warps(q_heads_pad * half_pad),
            enable_fp_fusion=False,
        )
    return query_out, key_out


# --- SiLU-and-mul -----------------------------------------------------------------------------------

_SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, x_stride, size, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    row = x_ptr + token * x_stride
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + size + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # F.silu's formula in both of PyTorch's kernels, CPU and CUDA: x / (1 + exp(-x)), IEEE division.
    silu = _round(tl.math.div_rn(gate, 1.0 + _exp(-gate)), dtype)
    out = _round(silu * up, dtype)
    tl.store(out_ptr + token * size + cols, out.to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] laid out as (gate, up) -> silu(gate) * up [..., d], as a new contiguous tensor."""
    size = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], size), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(triton.next_power_of_2(size), _SILU_BLOCK)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
            out, rows, rows.stride(0), size, BLOCK=block, num_warps=_num_warps(block), enable_fp_fusion=False
        )
    return out
