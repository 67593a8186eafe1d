"""Fused Triton kernels for a decoder layer's elementwise work: RMSNorm (with the residual add),
Qwen3's per-head q/k RMSNorm, rotary embedding (optionally with that q/k norm in the same launch)
and SiLU-and-mul, one launch each. One file, since every kernel follows the same rounding rule
(``_round``, below) that makes it PyTorch's twin, and the kernels share their maths.

Why: unfused, each of these ops is several tiny elementwise and reduction kernels per decoder layer
(2 for SiLU-and-mul, up to 16 for rotary embedding), and in a large decode batch those launches take
a large share of the step's GPU time. What the kernels save is measured on the GPU
(``benchmarks/throughput.py --custom-ops=none,+sampler`` against the default; docs/benchmarks.md,
"The recipe"), not claimed here.

Each kernel is a twin of a CustomOp's ``forward_native`` in ``norm.py``, ``rotary.py``,
``qk_norm_rope.py`` and ``activation.py``, not an approximation of it: PyTorch computes every
bf16/fp16 elementwise op in fp32 and rounds the result to the tensor's dtype, so the kernels compute
in fp32 and round (``_round``) at exactly the points where the PyTorch code ends an op. Launches pass
``enable_fp_fusion=False`` so a product is rounded before it is added, as it is between two PyTorch
kernels. What can still differ is the order of the fp32 sum in RMSNorm's variance, which may move
an output by an ulp.

The layers call these ops when ``ModelConfig.custom_ops`` enables them (by default on CUDA); the
tests call them on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``). CUDA-graph safe:
grids and block shapes depend on tensor shapes only, outputs are allocated by shape, and nothing on
the host reads device data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (nearest even, as PyTorch rounds), returned as fp32.

    Keeping rounded intermediates in fp32 lets every op run in fp32, and a final store to a
    ``DTYPE`` pointer is then exact.
    """
    if DTYPE == tl.float32:
        y = x
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


def _mean_by_division(x: torch.Tensor) -> bool:
    """The ``MEAN_BY_DIVISION`` of a launch on ``x``'s device: how PyTorch's RMSNorm takes its mean there
    (``_inv_rms``)."""
    return x.device.type == "cpu"


@triton.jit
def _inv_rms(sum_sq, eps, N: tl.constexpr, MEAN_BY_DIVISION: tl.constexpr):
    """``1 / sqrt(sum_sq / N + eps)`` with the mean PyTorch's RMSNorm computes on each device."""
    if MEAN_BY_DIVISION:
        variance = sum_sq / N  # PyTorch's CPU mean: the sum divided by N
    else:
        variance = sum_sq * (1.0 / N)  # its CUDA mean: the sum times an fp32 factor 1 / N
    return tl.math.rsqrt(variance + eps)


@triton.jit
def _rms_norm_rows(x, weight_ptr, cols, eps, N: tl.constexpr, DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                   MEAN_BY_DIVISION: tl.constexpr):
    """RMSNorm of each row of fp32 ``x`` [rows, BLOCK] times the weight at ``weight_ptr + cols``
    (``cols``: [BLOCK], each column's channel; ``x`` is zero where it is ``N`` or more), rounded as
    ``RMSNorm.forward_native`` rounds: to the input's ``DTYPE`` after the normalization, to
    ``OUT_DTYPE`` after the weight."""
    inv_rms = _inv_rms(tl.sum(x * x, axis=1), eps, N, MEAN_BY_DIVISION)
    normalized = _round(x * inv_rms[:, None], DTYPE)
    weight = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    return _round(normalized * weight[None, :], OUT_DTYPE)


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

    out = _rms_norm_rows(x, weight_ptr, cols, eps, N, dtype, out_ptr.dtype.element_ty, MEAN_BY_DIVISION)
    tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [A, B, N] with unit stride along N, without copying 2-D and 3-D inputs."""
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
            MEAN_BY_DIVISION=_mean_by_division(x),
            num_warps=_num_warps(block_rows * block_n),
            enable_fp_fusion=False,
        )
    return out if residual is None else (out, residual_out)


# --- q/k norm --------------------------------------------------------------------------------------


@triton.jit
def _norm_heads(
    src_row,
    dst_row,
    weight_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    """RMSNorm each head of one token, all heads sharing ``weight_ptr``."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_HEADS) & (dims[None, :] < HEAD_SIZE)
    offset = heads * HEAD_SIZE + dims[None, :]
    dtype = dst_row.dtype.element_ty
    x = tl.load(src_row + offset, mask=mask, other=0.0).to(tl.float32)
    out = _rms_norm_rows(x, weight_ptr, dims, eps, HEAD_SIZE, dtype, dtype, MEAN_BY_DIVISION)
    tl.store(dst_row + offset, out.to(dtype), mask=mask)


@triton.jit
def _qk_norm_kernel(
    query_out_ptr,  # [T, NUM_Q_HEADS * HEAD_SIZE] contiguous
    key_out_ptr,  # [T, NUM_K_HEADS * HEAD_SIZE] contiguous
    query_ptr,
    key_ptr,
    q_weight_ptr,  # [HEAD_SIZE]
    k_weight_ptr,
    q_eps,
    k_eps,
    query_stride,
    key_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    _norm_heads(
        query_ptr + token * query_stride,
        query_out_ptr + token * (NUM_Q_HEADS * HEAD_SIZE),
        q_weight_ptr, q_eps, NUM_Q_HEADS, Q_HEADS_PAD, HEAD_SIZE, BLOCK_D, MEAN_BY_DIVISION,
    )
    _norm_heads(
        key_ptr + token * key_stride,
        key_out_ptr + token * (NUM_K_HEADS * HEAD_SIZE),
        k_weight_ptr, k_eps, NUM_K_HEADS, K_HEADS_PAD, HEAD_SIZE, BLOCK_D, MEAN_BY_DIVISION,
    )


def _heads_in_out(query: torch.Tensor, key: torch.Tensor, head_size: int):
    """For the kernels that run one program per token over all its query and key heads: ``query``
    and ``key`` with unit stride along their channels, new contiguous outputs of their shapes, and
    the kernels' head-count constexprs."""
    if query.dtype != key.dtype:
        raise ValueError(f"query and key must share a dtype, got {query.dtype} and {key.dtype}")
    query, key = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key))
    num_q_heads, num_k_heads = query.shape[1] // head_size, key.shape[1] // head_size
    heads = dict(
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HEAD_SIZE=head_size,
    )
    outs = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (query, key))
    return query, key, outs, heads


def _check_norm_weights(query: torch.Tensor, *norms: tuple[torch.Tensor, float]) -> None:
    # The kernels round the norm's output to the query's dtype once, which is PyTorch's result only
    # when the weight does not promote it.
    if any(weight.dtype != query.dtype for weight, _ in norms):
        raise ValueError(f"the q/k norm weights must have the query's dtype {query.dtype}")


def qk_norm(
    query: torch.Tensor,
    key: torch.Tensor,
    q_norm: tuple[torch.Tensor, float],
    k_norm: tuple[torch.Tensor, float],
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm each head of flat ``query`` [T, H * D] and ``key`` [T, Hkv * D], the query's heads with
    ``q_norm`` (weight [D], eps) and the key's with ``k_norm``, as ``QKNorm.forward`` does.

    The inputs may be column slices of one fused qkv tensor (any row stride); the outputs are new
    contiguous tensors, the inputs untouched.
    """
    _check_norm_weights(query, q_norm, k_norm)
    query, key, (query_out, key_out), heads = _heads_in_out(query, key, head_size)
    (q_weight, q_eps), (k_weight, k_eps) = q_norm, k_norm
    if query.shape[0] > 0:
        block_d = triton.next_power_of_2(head_size)
        _qk_norm_kernel[(query.shape[0],)](
            query_out,
            key_out,
            query,
            key,
            q_weight,
            k_weight,
            q_eps,
            k_eps,
            query.stride(0),
            key.stride(0),
            **heads,
            BLOCK_D=block_d,
            MEAN_BY_DIVISION=_mean_by_division(query),
            num_warps=_num_warps(heads["Q_HEADS_PAD"] * block_d),
            enable_fp_fusion=False,
        )
    return query_out, key_out


# --- rotary embedding, alone or after the q/k norm --------------------------------------------------


@triton.jit
def _norm_halves(first, second, weight_ptr, eps, HEADS_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
                 HALF_PAD: tl.constexpr, DTYPE: tl.constexpr, MEAN_BY_DIVISION: tl.constexpr):
    """RMSNorm of heads held as their halves ([HEADS_PAD, HALF_PAD] each, zero past HEAD_SIZE / 2),
    returned as halves: in registers the halves become one tile of whole heads, a row each, for
    ``_rms_norm_rows``, and the result is cut back. Where HEAD_SIZE is a power of two the tile is the
    q/k norm kernel's, channel for column."""
    half: tl.constexpr = HEAD_SIZE // 2
    cols = tl.arange(0, 2 * HALF_PAD)
    # Each tile column's channel; HEAD_SIZE (no channel: no weight) at the padding.
    channels = tl.where(cols % HALF_PAD < half, cols // HALF_PAD * half + cols % HALF_PAD, HEAD_SIZE)
    heads = tl.reshape(tl.permute(tl.join(first, second), (0, 2, 1)), (HEADS_PAD, 2 * HALF_PAD))
    normalized = _rms_norm_rows(heads, weight_ptr, channels, eps, HEAD_SIZE, DTYPE, DTYPE, MEAN_BY_DIVISION)
    return tl.split(tl.permute(tl.reshape(normalized, (HEADS_PAD, 2, HALF_PAD)), (0, 2, 1)))


@triton.jit
def _rotate_heads(
    src_row,
    dst_row,
    cos,
    sin,
    weight_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    """Rotates all heads of one token (channel i pairs with channel i + HEAD_SIZE / 2); with QK_NORM,
    RMS-normalizes each head with the weight at ``weight_ptr`` first, in registers."""
    half: tl.constexpr = HEAD_SIZE // 2
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < half)
    offset = heads * HEAD_SIZE + dims
    dtype = dst_row.dtype.element_ty
    first = tl.load(src_row + offset, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src_row + offset + half, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        first, second = _norm_halves(first, second, weight_ptr, eps, HEADS_PAD, HEAD_SIZE, HALF_PAD, dtype,
                                     MEAN_BY_DIVISION)
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
    q_weight_ptr,  # [HEAD_SIZE] (read only with QK_NORM)
    k_weight_ptr,
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
    QK_NORM: tl.constexpr,
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
        cos, sin, q_weight_ptr, q_eps, NUM_Q_HEADS, Q_HEADS_PAD, HEAD_SIZE, HALF_PAD, QK_NORM, MEAN_BY_DIVISION,
    )
    _rotate_heads(
        key_ptr + token * key_stride,
        key_out_ptr + token * (NUM_K_HEADS * HEAD_SIZE),
        cos, sin, k_weight_ptr, k_eps, NUM_K_HEADS, K_HEADS_PAD, HEAD_SIZE, HALF_PAD, QK_NORM, MEAN_BY_DIVISION,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates flat ``query`` [T, H * D] and ``key`` [T, Hkv * D] by their tokens' positions.

    The inputs may be column slices of one fused qkv tensor (any row stride). Out of place, as the
    PyTorch path is, so the two paths have one contract: new contiguous tensors, inputs untouched.
    """
    return _rotary(positions, query, key, cos_sin_cache, head_size, qk_norms=None)


def fused_qk_norm_rope(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_norm: tuple[torch.Tensor, float],
    k_norm: tuple[torch.Tensor, float],
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm`` and then ``rotary_embedding`` in one launch, reading q and k once and writing them
    once, as ``QKNormRoPE.forward`` does; the arguments and outputs are theirs."""
    _check_norm_weights(query, q_norm, k_norm)
    return _rotary(positions, query, key, cos_sin_cache, head_size, qk_norms=(q_norm, k_norm))


def _rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    qk_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, (query_out, key_out), heads = _heads_in_out(query, key, head_size)
    positions = positions.contiguous()  # a no-op for the runner's positions
    # Without the norm the kernel reads no weight: any pointer will do.
    (q_weight, q_eps), (k_weight, k_eps) = qk_norms or ((cos_sin_cache, 0.0),) * 2
    if query.shape[0] > 0:
        half_pad = triton.next_power_of_2(head_size // 2)
        _rotary_kernel[(query.shape[0],)](
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
            **heads,
            HALF_PAD=half_pad,
            QK_NORM=qk_norms is not None,
            MEAN_BY_DIVISION=_mean_by_division(query),
            num_warps=_num_warps(heads["Q_HEADS_PAD"] * half_pad),
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
    # libdevice's exp is expf, as PyTorch's CUDA kernels use; tl.exp is a faster approximation.
    silu = _round(tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)), dtype)
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
