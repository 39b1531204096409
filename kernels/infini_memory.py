"""Infini-attention's compressive memory on segments: the per-segment updates and the gated
retrieval, forward and backward, as Triton kernels that read the inputs once per pass.

With sigma(x) = ELU(x) + 1 (x + 1 above 0, exp(x) below), for segment s of a batch row and key/value
head, and query head h reading key/value head h // (heads / kv_heads):

    update:    dM_s = sigma(K_s)^T V_s  (head_dim x head_dim),   dz_s = sum over tokens of sigma(K_s)
    retrieval: A = sigma(Q_s) M_s / (sigma(Q_s) z_s), 0 where sigma(Q_s) z_s = 0 (empty memory)
    output:    out = gate_h * A + (1 - gate_h) * local

where (M_s, z_s) is the float32 memory before segment s (the caller builds it from the updates).
sigma, the division, the gate and the casts stay in registers; the head_dim x head_dim products
run on tensor cores with bf16 operands and float32 accumulation for bf16 inputs, and with float32
operands otherwise (exact for float32, TF32 for float16, whose inputs carry no more bits). The
memories are float32; for bf16 inputs the retrieval reads a bf16 copy of them, the operand its
products would round them to anyway.

Tensors: q, local, out (batch, seqlen, heads, head_dim) and k, v (batch, seqlen, kv_heads,
head_dim) with a contiguous last dim; memories (batch, segments, kv_heads, head_dim, head_dim)
and (batch, segments, kv_heads, head_dim) float32, contiguous; gate (heads,) float32. Segment s
covers tokens [s * segment_len, min((s + 1) * segment_len, seqlen)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_d


@triton.jit
def _sigma(x):
    return tl.where(x > 0, x + 1.0, tl.exp(x))


@triton.jit
def _sigma_grad(sigma):
    """sigma'(x) from sigma(x): 1 above 0 (where sigma > 1), exp(x) = sigma below."""
    return tl.where(sigma > 1.0, 1.0, sigma)


@triton.jit
def _operand(x, LOW_PRECISION: tl.constexpr):
    """A matmul operand: bf16 (LOW_PRECISION) or float32; converted once, where it is loaded."""
    if LOW_PRECISION:
        x = x.to(tl.bfloat16)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _dot(a, b, acc, LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with float32 accumulation; operands bf16 (LOW_PRECISION) or float32."""
    return tl.dot(_operand(a, LOW_PRECISION), _operand(b, LOW_PRECISION), acc, input_precision=DOT_PRECISION)


@triton.jit
def _segment(pid_bs, n_seg, segment_len, seqlen):
    """(batch row as int64, first token, end token) of program axis value b * n_seg + s."""
    b = (pid_bs // n_seg).to(tl.int64)
    start = (pid_bs % n_seg) * segment_len
    return b, start, tl.minimum(start + segment_len, seqlen)


@triton.jit
def _load_sigma(ptr, rows, row_ok, offs_d, stride_s, HEAD_DIM: tl.constexpr):
    """sigma of a (rows, BLOCK_D) tile in float32, 0 outside the tile's valid part."""
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(ptr + rows[:, None].to(tl.int64) * stride_s + offs_d[None, :], mask=mask, other=0.0)
    return tl.where(mask, _sigma(x.to(tl.float32)), 0.0)


@triton.jit
def _update_kernel(
    K, V, DM, DZ, seqlen, n_seg, segment_len, kv_heads,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (segment, kv head, column block): dM_s[:, cols] and (column block 0) dz_s."""
    pid_bs = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    pid_n = tl.program_id(2)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh + cols[None, :]
    acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_M):
        rows = t0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        keys = _load_sigma(k_base, rows, row_ok, offs_d, stride_ks, HEAD_DIM)
        vmask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
        v = tl.load(v_base + rows[:, None].to(tl.int64) * stride_vs, mask=vmask, other=0.0)
        acc = _dot(tl.trans(keys), v, acc, LOW_PRECISION, DOT_PRECISION)
        z += tl.sum(keys, 0)
    state = pid_bs.to(tl.int64) * kv_heads + h
    d_ok = offs_d < HEAD_DIM
    dm_ptrs = DM + (state * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + cols[None, :]
    tl.store(dm_ptrs, acc, mask=d_ok[:, None] & (cols[None, :] < HEAD_DIM))
    tl.store(DZ + state * HEAD_DIM + offs_d, z, mask=d_ok & (pid_n == 0))


@triton.jit
def _update_backward_kernel(
    K, V, GDM, GDZ, DK, DV, seqlen, n_seg, segment_len, kv_heads,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (token block, segment, kv head): dV = sigma(K) gdM, dK = (V gdM^T + gdz) sigma'(K)."""
    pid_m = tl.program_id(0)
    pid_bs = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    keys = _load_sigma(K + b * stride_kb + h * stride_kh, rows, row_ok, offs_d, stride_ks, HEAD_DIM)
    keys = _operand(keys, LOW_PRECISION)
    state = pid_bs.to(tl.int64) * kv_heads + h
    gz = tl.load(GDZ + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    dkeys = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32) + gz[None, :]
    rows64 = rows[:, None].to(tl.int64)
    for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < HEAD_DIM
        gm_ptrs = GDM + (state * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + cols[None, :]
        gm = _operand(tl.load(gm_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0), LOW_PRECISION)
        vmask = row_ok[:, None] & col_ok[None, :]
        v = tl.load(
            V + b * stride_vb + h * stride_vh + rows64 * stride_vs + cols[None, :], mask=vmask, other=0.0
        )
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        dv = _dot(keys, gm, zero, LOW_PRECISION, DOT_PRECISION)
        dv_ptrs = DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvs + cols[None, :]
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=vmask)
        dkeys = _dot(v, tl.trans(gm), dkeys, LOW_PRECISION, DOT_PRECISION)
    dk = dkeys * _sigma_grad(keys.to(tl.float32))
    dk_ptrs = DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dks + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _retrieval_kernel(
    Q, LOCAL, OUT, M, Z, GATE, seqlen, n_seg, segment_len, heads, kv_heads,
    stride_qb, stride_qs, stride_qh, stride_lb, stride_ls, stride_lh, stride_ob, stride_os, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (token block, segment, query head): out = gate A + (1 - gate) local."""
    pid_m = tl.program_id(0)
    pid_bs = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rows64 = rows[:, None].to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    queries = _load_sigma(Q + b * stride_qb + h * stride_qh, rows, row_ok, offs_d, stride_qs, HEAD_DIM)
    state = pid_bs.to(tl.int64) * kv_heads + h // GROUP
    z = tl.load(Z + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    den = tl.sum(queries * z[None, :], 1)
    queries = _operand(queries, LOW_PRECISION)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    gate = tl.load(GATE + h)
    for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < HEAD_DIM
        m_ptrs = M + (state * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + cols[None, :]
        m = _operand(tl.load(m_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0), LOW_PRECISION)
        num = _dot(queries, m, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), LOW_PRECISION, DOT_PRECISION)
        mask = row_ok[:, None] & col_ok[None, :]
        local = tl.load(LOCAL + b * stride_lb + h * stride_lh + rows64 * stride_ls + cols[None, :], mask=mask)
        out = gate * (num * inv[:, None]) + (1.0 - gate) * local.to(tl.float32)
        o_ptrs = OUT + b * stride_ob + h * stride_oh + rows64 * stride_os + cols[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _retrieval_backward_kernel(
    Q, LOCAL, DOUT, DQ, DLOCAL, M, Z, GATE, INV, GDEN, GGATE, seqlen, n_seg, segment_len, heads, kv_heads,
    stride_qb, stride_qs, stride_qh, stride_lb, stride_ls, stride_lh, stride_gb, stride_gs, stride_gh,
    stride_dqb, stride_dqs, stride_dqh, stride_dlb, stride_dls, stride_dlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (token block, segment, query head): dq, dlocal = (1 - gate) dout, this block's part of
    the gate's gradient, and per row 1 / den and d den for the memory-gradient pass."""
    pid_m = tl.program_id(0)
    pid_bs = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rows64 = rows[:, None].to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    queries = _load_sigma(Q + b * stride_qb + h * stride_qh, rows, row_ok, offs_d, stride_qs, HEAD_DIM)
    state = pid_bs.to(tl.int64) * kv_heads + h // GROUP
    z = tl.load(Z + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    den = tl.sum(queries * z[None, :], 1)
    queries = _operand(queries, LOW_PRECISION)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    gate = tl.load(GATE + h)
    dqueries = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dout_a = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum over columns of dout * A
    dout_mix = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum over columns of dout * (A - local)
    for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < HEAD_DIM
        mask = row_ok[:, None] & col_ok[None, :]
        m_ptrs = M + (state * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + cols[None, :]
        m = _operand(tl.load(m_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0), LOW_PRECISION)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a = _dot(queries, m, zero, LOW_PRECISION, DOT_PRECISION) * inv[:, None]
        local = tl.load(LOCAL + b * stride_lb + h * stride_lh + rows64 * stride_ls + cols[None, :], mask=mask)
        g_ptrs = DOUT + b * stride_gb + h * stride_gh + rows64 * stride_gs + cols[None, :]
        dout = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        dl_ptrs = DLOCAL + b * stride_dlb + h * stride_dlh + rows64 * stride_dls + cols[None, :]
        tl.store(dl_ptrs, ((1.0 - gate) * dout).to(DLOCAL.dtype.element_ty), mask=mask)
        dout_a += tl.sum(dout * a, 1)
        dout_mix += tl.sum(tl.where(mask, dout * (a - local.to(tl.float32)), 0.0), 1)
        dnum = dout * (gate * inv)[:, None]
        dqueries = _dot(dnum, tl.trans(m), dqueries, LOW_PRECISION, DOT_PRECISION)
    gden = -gate * dout_a * inv  # d/d den of num / den = -(dA . A) / den
    dqueries += gden[:, None] * z[None, :]
    dq = dqueries * _sigma_grad(queries.to(tl.float32))
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows64 * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    row_idx = (b * heads + h) * seqlen + rows
    tl.store(INV + row_idx, inv, mask=row_ok)
    tl.store(GDEN + row_idx, gden, mask=row_ok)
    n_m = tl.num_programs(0)
    tl.store(GGATE + (pid_bs.to(tl.int64) * heads + h) * n_m + pid_m, tl.sum(dout_mix, 0))


@triton.jit
def _retrieval_state_backward_kernel(
    Q, DOUT, INV, GDEN, GATE, GM, GZ, seqlen, n_seg, segment_len, heads, kv_heads,
    stride_qb, stride_qs, stride_qh, stride_gb, stride_gs, stride_gh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (segment, kv head, column block): the gradient of the memory before the segment,
    summed over its tokens and the query heads that read it."""
    pid_bs = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    pid_n = tl.program_id(2)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HEAD_DIM
    acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    gz = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for g in range(GROUP):
        h = kvh * GROUP + g
        gate = tl.load(GATE + h)
        q_base = Q + b * stride_qb + h * stride_qh
        for t0 in range(start, end, BLOCK_M):
            rows = t0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            queries = _load_sigma(q_base, rows, row_ok, offs_d, stride_qs, HEAD_DIM)
            row_idx = (b * heads + h) * seqlen + rows
            inv = tl.load(INV + row_idx, mask=row_ok, other=0.0)
            gden = tl.load(GDEN + row_idx, mask=row_ok, other=0.0)
            g_ptrs = (
                DOUT + b * stride_gb + h * stride_gh + rows[:, None].to(tl.int64) * stride_gs + cols[None, :]
            )
            dout = tl.load(g_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc = _dot(tl.trans(queries), dout * (gate * inv)[:, None], acc, LOW_PRECISION, DOT_PRECISION)
            gz += tl.sum(queries * gden[:, None], 0)
    state = pid_bs.to(tl.int64) * kv_heads + kvh
    gm_ptrs = GM + (state * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + cols[None, :]
    tl.store(gm_ptrs, acc, mask=d_ok[:, None] & col_ok[None, :])
    tl.store(GZ + state * HEAD_DIM + offs_d, gz, mask=d_ok & (pid_n == 0))


# Tiles, from the registers and spills of the sm_90 builds (bf16, head_dim 128, 8 warps,
# kernels/offline_compile.py); not yet timed on a GPU. The kernels that loop over column blocks
# (retrieval, its dq pass, the updates' backward) take all 128 columns at once: 64 rows x 128
# columns builds without spills (the dq pass needs 32 rows: 88 B spilled against 1.2 KB at 64).
# The per-segment sums (updates, the memory's gradient) have a column-block grid axis: 64 columns
# keep their float32 accumulator at 128 x 64 (the memory's gradient at 128 x 128 spills 1 KB);
# the updates take all columns at once (254 registers, no spill, k read once instead of twice)
# when there are at least WIDE_STATE_PROGRAMS (segment, head) programs to fill the GPU.
WIDE_STATE_PROGRAMS = 256


def _tiles(head_dim: int, dtype: torch.dtype, block_n: int, block_m: int) -> dict:
    bd = block_d(head_dim)
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=min(block_n, bd), BLOCK_M=block_m,
        LOW_PRECISION=dtype == torch.bfloat16, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=8 if bd >= 128 else 4,
    )  # fmt: skip


def _column_tile(head_dim: int) -> int:
    return 128 if head_dim <= 128 else 64


def _rows(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _matrix_operand(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The memories as the retrieval kernels read them: bf16 for bf16 inputs (the products'
    operands are bf16 there anyway; each token block reads its segment's memory, so this halves
    that traffic), float32 otherwise."""
    return m.to(torch.bfloat16).contiguous() if dtype == torch.bfloat16 else m.contiguous()


def _n_seg(seqlen: int, segment_len: int) -> int:
    return -(-seqlen // segment_len)


def memory_updates(k: torch.Tensor, v: torch.Tensor, segment_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What each segment adds to the memory: k, v (batch, seqlen, kv_heads, head_dim) ->
    (sigma(K_s)^T V_s (batch, segments, kv_heads, head_dim, head_dim), sum of sigma(K_s)
    (batch, segments, kv_heads, head_dim)), float32."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    b, s, kv_heads, d = k.shape
    n_seg = _n_seg(s, segment_len)
    dm = torch.empty(b, n_seg, kv_heads, d, d, device=k.device, dtype=torch.float32)
    dz = torch.empty(b, n_seg, kv_heads, d, device=k.device, dtype=torch.float32)
    wide = b * n_seg * kv_heads >= WIDE_STATE_PROGRAMS and d <= 128
    tiles = _tiles(d, k.dtype, 128 if wide else 64, _rows(d))
    grid = (b * n_seg, kv_heads, triton.cdiv(d, tiles["BLOCK_N"]))
    _update_kernel[grid](
        k, v, dm, dz, s, n_seg, segment_len, kv_heads, *k.stride()[:3], *v.stride()[:3],
        **tiles,
    )  # fmt: skip
    return dm, dz


def memory_updates_backward(
    k: torch.Tensor, v: torch.Tensor, segment_len: int, grad_dm: torch.Tensor, grad_dz: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (dk, dv) of ``memory_updates`` given those of its two outputs."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    b, s, kv_heads, d = k.shape
    n_seg = _n_seg(s, segment_len)
    grad_dm, grad_dz = grad_dm.float().contiguous(), grad_dz.float().contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    tiles = _tiles(d, k.dtype, _column_tile(d), _rows(d))
    grid = (triton.cdiv(min(segment_len, s), tiles["BLOCK_M"]), b * n_seg, kv_heads)
    _update_backward_kernel[grid](
        k, v, grad_dm, grad_dz, dk, dv, s, n_seg, segment_len, kv_heads,
        *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        **tiles,
    )  # fmt: skip
    return dk, dv


def memory_retrieval(
    q: torch.Tensor,
    local: torch.Tensor,
    gate: torch.Tensor,
    m_before: torch.Tensor,
    z_before: torch.Tensor,
    segment_len: int,
) -> torch.Tensor:
    """gate * sigma(Q) M / (sigma(Q) z) + (1 - gate) * local per segment (module docstring):
    q, local (batch, seqlen, heads, head_dim) -> out, same shape, in q's dtype."""
    q, local = _last_dim_contiguous(q), _last_dim_contiguous(local)
    b, s, heads, d = q.shape
    n_seg, kv_heads = m_before.shape[1], m_before.shape[2]
    out = torch.empty_like(q)
    tiles = _tiles(d, q.dtype, _column_tile(d), _rows(d))
    grid = (triton.cdiv(min(segment_len, s), tiles["BLOCK_M"]), b * n_seg, heads)
    _retrieval_kernel[grid](
        q, local, out, _matrix_operand(m_before, q.dtype), z_before.contiguous(), gate.float().contiguous(),
        s, n_seg, segment_len, heads, kv_heads, *q.stride()[:3], *local.stride()[:3], *out.stride()[:3],
        GROUP=heads // kv_heads, **tiles,
    )  # fmt: skip
    return out


def memory_retrieval_backward(
    q: torch.Tensor,
    local: torch.Tensor,
    gate: torch.Tensor,
    m_before: torch.Tensor,
    z_before: torch.Tensor,
    segment_len: int,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``memory_retrieval``: (dq, dlocal, dgate (heads,) float32, d m_before,
    d z_before (float32, m_before's and z_before's shapes))."""
    q, local, dout = (_last_dim_contiguous(t) for t in (q, local, dout))
    b, s, heads, d = q.shape
    n_seg, kv_heads = m_before.shape[1], m_before.shape[2]
    m_before, z_before, gate = m_before.contiguous(), z_before.contiguous(), gate.float().contiguous()
    dq, dlocal = torch.empty_like(q), torch.empty_like(local)
    inv = torch.empty(b, heads, s, device=q.device, dtype=torch.float32)
    gden = torch.empty_like(inv)
    tiles = _tiles(d, q.dtype, _column_tile(d), 32)
    n_m = triton.cdiv(min(segment_len, s), tiles["BLOCK_M"])
    ggate = torch.empty(b * n_seg, heads, n_m, device=q.device, dtype=torch.float32)
    group = heads // kv_heads
    _retrieval_backward_kernel[(n_m, b * n_seg, heads)](
        q, local, dout, dq, dlocal, _matrix_operand(m_before, q.dtype), z_before, gate, inv, gden, ggate,
        s, n_seg, segment_len, heads, kv_heads,
        *q.stride()[:3], *local.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], *dlocal.stride()[:3],
        GROUP=group, **tiles,
    )  # fmt: skip
    gm, gz = torch.empty_like(m_before), torch.empty_like(z_before)
    tiles = _tiles(d, q.dtype, 64, _rows(d))
    _retrieval_state_backward_kernel[(b * n_seg, kv_heads, triton.cdiv(d, tiles["BLOCK_N"]))](
        q, dout, inv, gden, gate, gm, gz, s, n_seg, segment_len, heads, kv_heads,
        *q.stride()[:3], *dout.stride()[:3], GROUP=group, **tiles,
    )  # fmt: skip
    return dq, dlocal, ggate.sum((0, 2)), gm, gz
