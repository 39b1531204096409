"""Infini-attention's delta-rule memory recurrence and its backward as Triton kernels.

For segment s of a batch row and key/value head, with sigma = ELU + 1, K~ = sigma(K_s) and the
memory (M, z) before the segment:

    den = K~ z                          (one number per token)
    R   = K~ M / den                    (0 where den = 0: an empty memory retrieves nothing)
    M  += K~^T (V_s - R)

z before each segment is a plain sum over segments (computed outside). Column block c of M only
reads column block c of M and V, so one program per (batch row, kv head, column block) walks the
segments in order with its block of M in registers (float32), writing the memory before each
segment for the retrieval; the backward walks them in reverse with the block of dM carried. The
gradient of K~ and of z sums over all columns: with several column blocks each block adds its
part of dK into one float32 buffer (atomic adds; with torch's deterministic algorithms, one part
per block, summed after the kernel) and writes its part of dz.

The products keep float32 operands: the residual V - R is a difference of similar numbers, so
they are exact float32 ("ieee") for float32 inputs and TF32 (10 mantissa bits, more than bf16's
7) for float16 and bfloat16 inputs, with float32 accumulation.

Tensors: k, v (batch, seqlen, kv_heads, head_dim) with a contiguous last dim; memories before
each segment (batch, segments, kv_heads, head_dim, head_dim) and z before each segment (batch,
segments, kv_heads, head_dim), float32, contiguous. Segment s covers tokens
[s * segment_len, min((s + 1) * segment_len, seqlen)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import block_d
from .memory import _load_sigma, _sigma_grad, last_dim_contiguous


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _retrieved(keys, m, z, DOT_PRECISION: tl.constexpr):
    """(R = K~ M / den, 1 / den) for a (rows, BLOCK_D) tile of keys; both 0 where den = 0."""
    den = tl.sum(keys * z[None, :], 1)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    num = _dot(keys, m, tl.zeros((keys.shape[0], m.shape[1]), dtype=tl.float32), DOT_PRECISION)
    return num * inv[:, None], inv


@triton.jit
def _delta_forward_kernel(
    K, V, M_IN, Z_BEFORE, M_BEFORE, M_FINAL, seqlen, n_seg, segment_len, kv_heads,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (batch row, kv head, column block): M_BEFORE[s][:, cols] for every segment and
    M_FINAL[:, cols], from M_IN[:, cols]."""
    pid = tl.program_id(0).to(tl.int64)
    b, h = pid // kv_heads, pid % kv_heads
    offs_d = tl.arange(0, BLOCK_D)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d_ok, col_ok = offs_d < HEAD_DIM, cols < HEAD_DIM
    state_mask = d_ok[:, None] & col_ok[None, :]
    state_offs = offs_d[:, None] * HEAD_DIM + cols[None, :]
    m = tl.load(M_IN + pid * HEAD_DIM * HEAD_DIM + state_offs, mask=state_mask, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh + cols[None, :]
    for s in range(0, n_seg):
        state = (b * n_seg + s) * kv_heads + h
        tl.store(M_BEFORE + state * HEAD_DIM * HEAD_DIM + state_offs, m, mask=state_mask)
        z = tl.load(Z_BEFORE + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        start = s * segment_len
        end = tl.minimum(start + segment_len, seqlen)
        update = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_M):
            rows = t0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            keys = _load_sigma(k_base, rows, row_ok, offs_d, stride_ks, HEAD_DIM)
            vmask = row_ok[:, None] & col_ok[None, :]
            v = tl.load(v_base + rows[:, None].to(tl.int64) * stride_vs, mask=vmask, other=0.0)
            retrieved, inv = _retrieved(keys, m, z, DOT_PRECISION)
            update = _dot(tl.trans(keys), v.to(tl.float32) - retrieved, update, DOT_PRECISION)
        m += update
    tl.store(M_FINAL + pid * HEAD_DIM * HEAD_DIM + state_offs, m, mask=state_mask)


@triton.jit
def _delta_backward_kernel(
    K, V, M_BEFORE, Z_BEFORE, GM_BEFORE, GM_FINAL, GM_IN, GZ_PART, DK_PART, DV,
    seqlen, n_seg, segment_len, kv_heads, gz_part_stride, dk_part_stride,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    HAS_FINAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DK: tl.constexpr,
):  # fmt: skip
    """One (batch row, kv head, column block), segments in reverse, G = dL/dM after segment s:

        dV = K~ G,   dR = -dV,   dN = dR / den,   dden = -rowsum(dR R) / den
        dK~ += (V - R) G^T + dN M^T + dden z^T,   dz += K~^T dden
        dM before s = G + K~^T dN + (the retrieval's gradient of M before s)

    dV[:, cols] is this block's alone; dK (times sigma') and dz are this block's parts
    (float32, one slice of GZ_PART / DK_PART per column block), summed over blocks afterwards;
    under ATOMIC_DK the blocks add their dK parts into one float32 DK_PART instead."""
    pid = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    b, h = pid // kv_heads, pid % kv_heads
    offs_d = tl.arange(0, BLOCK_D)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d_ok, col_ok = offs_d < HEAD_DIM, cols < HEAD_DIM
    state_mask = d_ok[:, None] & col_ok[None, :]
    state_offs = offs_d[:, None] * HEAD_DIM + cols[None, :]
    if HAS_FINAL:
        g = tl.load(GM_FINAL + pid * HEAD_DIM * HEAD_DIM + state_offs, mask=state_mask, other=0.0)
    else:
        g = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh + cols[None, :]
    dk_base = DK_PART + pid_n.to(tl.int64) * dk_part_stride + b * stride_dkb + h * stride_dkh
    dk_base += offs_d[None, :]
    dv_base = DV + b * stride_dvb + h * stride_dvh + cols[None, :]
    for step in range(0, n_seg):
        s = n_seg - 1 - step
        state = (b * n_seg + s) * kv_heads + h
        m = tl.load(M_BEFORE + state * HEAD_DIM * HEAD_DIM + state_offs, mask=state_mask, other=0.0)
        z = tl.load(Z_BEFORE + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        gm = tl.load(GM_BEFORE + state * HEAD_DIM * HEAD_DIM + state_offs, mask=state_mask, other=0.0)
        g_before = g + gm  # dL/dM before s: carried, the retrieval's, and (below) the segment's
        gz = tl.zeros((BLOCK_D,), dtype=tl.float32)
        start = s * segment_len
        end = tl.minimum(start + segment_len, seqlen)
        for t0 in range(start, end, BLOCK_M):
            rows = t0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            rows64 = rows[:, None].to(tl.int64)
            keys = _load_sigma(k_base, rows, row_ok, offs_d, stride_ks, HEAD_DIM)
            vmask = row_ok[:, None] & col_ok[None, :]
            v = tl.load(v_base + rows64 * stride_vs, mask=vmask, other=0.0)
            retrieved, inv = _retrieved(keys, m, z, DOT_PRECISION)
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            dv = _dot(keys, g, zero, DOT_PRECISION)
            tl.store(dv_base + rows64 * stride_dvs, dv.to(DV.dtype.element_ty), mask=vmask)
            dnum = -dv * inv[:, None]
            dden = tl.sum(dv * retrieved, 1) * inv
            dkeys = _dot(v.to(tl.float32) - retrieved, tl.trans(g), dden[:, None] * z[None, :], DOT_PRECISION)
            dkeys = _dot(dnum, tl.trans(m), dkeys, DOT_PRECISION)
            dk = dkeys * _sigma_grad(keys)
            dk_ptrs = dk_base + rows64 * stride_dks
            dk_mask = row_ok[:, None] & d_ok[None, :]
            if ATOMIC_DK:
                tl.atomic_add(dk_ptrs, dk, mask=dk_mask, sem="relaxed")
            else:
                tl.store(dk_ptrs, dk, mask=dk_mask)
            gz += tl.sum(keys * dden[:, None], 0)
            g_before = _dot(tl.trans(keys), dnum, g_before, DOT_PRECISION)
        tl.store(GZ_PART + pid_n.to(tl.int64) * gz_part_stride + state * HEAD_DIM + offs_d, gz, mask=d_ok)
        g = g_before
    tl.store(GM_IN + pid * HEAD_DIM * HEAD_DIM + state_offs, g, mask=state_mask)


# Columns of M per program: the recurrence runs batch x kv_heads x (head_dim / columns) programs,
# each over the whole sequence, so narrower blocks give more programs to fill the GPU (k is read
# once per block): the widest of 32, 16 columns that still gives DELTA_PROGRAMS programs (about
# one per SM), else 16. Tiles from the sm_90 builds (bf16, head_dim 64/128, 8 warps, ptxas -v):
# 32 rows x 16 or 32 columns, forward 105-182 registers, backward 184-255 with at most 8 B
# spilled; 64 rows or 64 columns spill 0.1-2 KB.
DELTA_PROGRAMS = 128
DELTA_MAX_COLUMNS = 32
DELTA_MIN_COLUMNS = 16
DELTA_ROWS = 32


def delta_columns(head_dim: int, states: int) -> int:
    """Columns of M per program for ``states`` (batch row, kv head) pairs."""
    bd = block_d(head_dim)
    columns = min(DELTA_MAX_COLUMNS, bd)
    while columns > DELTA_MIN_COLUMNS and states * triton.cdiv(head_dim, columns) < DELTA_PROGRAMS:
        columns //= 2
    return columns


def _tiles(head_dim: int, dtype: torch.dtype, states: int) -> dict:
    bd = block_d(head_dim)
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=delta_columns(head_dim, states), BLOCK_M=DELTA_ROWS,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=8 if bd >= 64 else 4,
    )  # fmt: skip


def delta_memories(
    k: torch.Tensor, v: torch.Tensor, m_in: torch.Tensor, z_before: torch.Tensor, segment_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over all segments: k, v (batch, seqlen, kv_heads, head_dim), m_in (batch,
    kv_heads, head_dim, head_dim) entering the sequence, z_before (batch, segments, kv_heads,
    head_dim) -> (M before each segment (batch, segments, kv_heads, head_dim, head_dim), M after
    the last one (batch, kv_heads, head_dim, head_dim)), float32."""
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    b, s, kv_heads, d = k.shape
    n_seg = z_before.shape[1]
    m_in, z_before = m_in.float().contiguous(), z_before.float().contiguous()
    m_before = torch.empty(b, n_seg, kv_heads, d, d, device=k.device, dtype=torch.float32)
    m_final = torch.empty_like(m_in)
    t = _tiles(d, k.dtype, b * kv_heads)
    _delta_forward_kernel[(b * kv_heads, triton.cdiv(d, t["BLOCK_N"]))](
        k, v, m_in, z_before, m_before, m_final, s, n_seg, segment_len, kv_heads,
        *k.stride()[:3], *v.stride()[:3], **t,
    )  # fmt: skip
    return m_before, m_final


def delta_memories_backward(
    k: torch.Tensor,
    v: torch.Tensor,
    m_before: torch.Tensor,
    z_before: torch.Tensor,
    segment_len: int,
    grad_m_before: torch.Tensor,
    grad_m_final: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dk, dv in k's dtype, d m_in, d z_before float32) of ``delta_memories`` given
    those of its outputs (grad_m_final None: zero)."""
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    b, s, kv_heads, d = k.shape
    n_seg = m_before.shape[1]
    t = _tiles(d, k.dtype, b * kv_heads)
    blocks = triton.cdiv(d, t["BLOCK_N"])
    # One float32 dK part per column block is blocks x the size of k in float32 (32 GiB at 1M
    # tokens, 8 heads of 128 in 16-column blocks); the blocks add into one part instead, unless
    # torch asks for deterministic algorithms (the order of the adds varies between runs).
    atomic = blocks > 1 and not torch.are_deterministic_algorithms_enabled()
    if atomic:
        dk_part = torch.zeros(1, b, s, kv_heads, d, device=k.device, dtype=torch.float32)
    else:
        dk_part = torch.empty(blocks, b, s, kv_heads, d, device=k.device, dtype=torch.float32)
    gz_part = torch.empty(blocks, *z_before.shape, device=k.device, dtype=torch.float32)
    dv = torch.empty_like(v)
    gm_in = torch.empty(b, kv_heads, d, d, device=k.device, dtype=torch.float32)
    grad_m_before = grad_m_before.float().contiguous()
    has_final = grad_m_final is not None
    grad_m_final = grad_m_final.float().contiguous() if has_final else gm_in
    _delta_backward_kernel[(b * kv_heads, blocks)](
        k, v, m_before.float().contiguous(), z_before.float().contiguous(), grad_m_before, grad_m_final,
        gm_in, gz_part, dk_part, dv, s, n_seg, segment_len, kv_heads, gz_part.stride(0),
        0 if atomic else dk_part.stride(0), *k.stride()[:3], *v.stride()[:3], *dk_part.stride()[1:4],
        *dv.stride()[:3], HAS_FINAL=has_final, ATOMIC_DK=atomic, **t,
    )  # fmt: skip
    dk = dk_part[0] if len(dk_part) == 1 else dk_part.sum(0)
    return dk.to(k.dtype), dv, gm_in, gz_part[0] if blocks == 1 else gz_part.sum(0)
