"""Infini-attention's gated retrieval from the memory before each segment, forward and backward,
as Triton kernels (the memory's updates and scan are in ``memory.py``):

    A   = sigma(Q_s) M_s / (sigma(Q_s) z_s), 0 where sigma(Q_s) z_s = 0 (an empty memory)
    out = gate_h * A + (1 - gate_h) * local

for segment s, query head h reading key/value head h // (heads / kv_heads). sigma, the division,
the gate and the casts stay in registers; a program takes a chunk of a segment's rows and, with
head_dim <= 128, reads the segment's M once before them.

Tensors: q, local, out (batch, seqlen, heads, head_dim) with a contiguous last dim; M (batch,
segments, kv_heads, head_dim, head_dim) in ``operand_dtype`` and z (batch, segments, kv_heads,
head_dim) float32, contiguous; gate (heads,) float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hopper.dispatch import hopper_module, uses_infini_retrieval, uses_infini_retrieval_backward
from .memory import (
    _dot,
    _inverse,
    _load_sigma,
    _load_state,
    _operand,
    _row_chunk,
    _segment,
    _sigma_grad,
    column_tile,
    last_dim_contiguous,
    operand_dtype,
    row_chunk,
    row_tile,
    tiles,
)


@triton.jit
def _retrieval_kernel(
    Q, LOCAL, OUT, M, Z, GATE, seqlen, n_seg, segment_len, chunk, kv_heads,
    stride_qb, stride_qs, stride_qh, stride_lb, stride_ls, stride_lh, stride_ob, stride_os, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (row chunk, segment, query head): out = gate A + (1 - gate) local."""
    pid_c = tl.program_id(0)
    pid_bs = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    b, lo, hi = _row_chunk(pid_c, pid_bs, n_seg, segment_len, chunk, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    state = pid_bs.to(tl.int64) * kv_heads + h // GROUP
    m_base = M + state * HEAD_DIM * HEAD_DIM
    z = tl.load(Z + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    gate = tl.load(GATE + h)
    if BLOCK_N == BLOCK_D:
        m_all = _load_state(m_base, offs_d, offs_d, HEAD_DIM, LOW_PRECISION)
    for t0 in range(lo, hi, BLOCK_M):
        rows = t0 + tl.arange(0, BLOCK_M)
        row_ok = rows < hi
        rows64 = rows[:, None].to(tl.int64)
        queries = _load_sigma(Q + b * stride_qb + h * stride_qh, rows, row_ok, offs_d, stride_qs, HEAD_DIM)
        den = tl.sum(queries * z[None, :], 1)
        queries = _operand(queries, LOW_PRECISION)
        scale = gate * _inverse(den)
        for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            if BLOCK_N == BLOCK_D:
                m = m_all
            else:
                m = _load_state(m_base, offs_d, cols, HEAD_DIM, LOW_PRECISION)
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            num = _dot(queries, m, zero, LOW_PRECISION, DOT_PRECISION)
            mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
            local_ptrs = LOCAL + b * stride_lb + h * stride_lh + rows64 * stride_ls + cols[None, :]
            local = tl.load(local_ptrs, mask=mask)
            out = num * scale[:, None] + (1.0 - gate) * local.to(tl.float32)
            o_ptrs = OUT + b * stride_ob + h * stride_oh + rows64 * stride_os + cols[None, :]
            tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _retrieval_backward_kernel(
    Q, LOCAL, DOUT, DQ, DLOCAL, M, Z, GATE, INV, GDEN, GGATE, DELTA, GM, GZ,
    seqlen, n_seg, segment_len, chunk, heads, kv_heads,
    stride_qb, stride_qs, stride_qh, stride_lb, stride_ls, stride_lh, stride_gb, stride_gs, stride_gh,
    stride_dqb, stride_dqs, stride_dqh, stride_dlb, stride_dls, stride_dlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOCAL_DELTA: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    """One (row chunk, segment, kv head), for each query head of its group: dq and this chunk's
    part of the gate's gradient; dlocal = (1 - gate) dout, or with LOCAL_DELTA instead the
    delta of a local attention's backward run on dout itself, rowsum(dout * local), laid out
    as its varlen LSE (heads, batch * seqlen). With STATE (all columns in one block) also this
    chunk's part of the gradients of the memory before the segment, summed over the group,
    into GM, GZ (chunks, batch * segments, kv_heads, head_dim[, head_dim]); without it, per row
    1 / den and d den for ``_retrieval_state_backward_kernel``."""
    pid_c = tl.program_id(0)
    pid_bs = tl.program_id(1)
    kvh = tl.program_id(2).to(tl.int64)
    b, lo, hi = _row_chunk(pid_c, pid_bs, n_seg, segment_len, chunk, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    state = pid_bs.to(tl.int64) * kv_heads + kvh
    m_base = M + state * HEAD_DIM * HEAD_DIM
    z = tl.load(Z + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    if BLOCK_N == BLOCK_D:
        m_all = _load_state(m_base, offs_d, offs_d, HEAD_DIM, LOW_PRECISION)
    if STATE:
        gm = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        gz = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for g in range(GROUP):
        h = kvh * GROUP + g
        gate = tl.load(GATE + h)
        gate_grad = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum over columns of dout * (A - local)
        q_base = Q + b * stride_qb + h * stride_qh
        for t0 in range(lo, hi, BLOCK_M):
            rows = t0 + tl.arange(0, BLOCK_M)
            row_ok = rows < hi
            rows64 = rows[:, None].to(tl.int64)
            queries = _load_sigma(q_base, rows, row_ok, offs_d, stride_qs, HEAD_DIM)
            den = tl.sum(queries * z[None, :], 1)
            inv = _inverse(den)
            # dout M^T gives both dq's product and, with sigma(Q), rowsum(dout * A): the
            # retrieval's sigma(Q) M is not formed again.
            dproj = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            dout_local = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum over columns of dout * local
            for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
                if BLOCK_N == BLOCK_D:
                    m = m_all
                else:
                    m = _load_state(m_base, offs_d, cols, HEAD_DIM, LOW_PRECISION)
                local_ptrs = LOCAL + b * stride_lb + h * stride_lh + rows64 * stride_ls + cols[None, :]
                local = tl.load(local_ptrs, mask=mask, other=0.0).to(tl.float32)
                g_ptrs = DOUT + b * stride_gb + h * stride_gh + rows64 * stride_gs + cols[None, :]
                dout = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
                if not LOCAL_DELTA:
                    dl_ptrs = DLOCAL + b * stride_dlb + h * stride_dlh + rows64 * stride_dls + cols[None, :]
                    tl.store(dl_ptrs, ((1.0 - gate) * dout).to(DLOCAL.dtype.element_ty), mask=mask)
                dout_local += tl.sum(dout * local, 1)
                dproj = _dot(dout, tl.trans(m), dproj, LOW_PRECISION, DOT_PRECISION)
                if STATE:
                    dnum = dout * (gate * inv)[:, None]  # d num, num = sigma(Q) M
                    gm = _dot(tl.trans(queries), dnum, gm, LOW_PRECISION, DOT_PRECISION)
            dout_a = tl.sum(queries * dproj, 1) * inv  # sum over columns of dout * A
            gden = -gate * dout_a * inv  # d/d den of num / den = -(dA . A) / den
            dqueries = dproj * (gate * inv)[:, None] + gden[:, None] * z[None, :]
            dq = dqueries * _sigma_grad(queries)
            dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows64 * stride_dqs + offs_d[None, :]
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            if STATE:
                gz += tl.sum(queries * gden[:, None], 0)
            else:
                row_idx = (b * heads + h) * seqlen + rows
                tl.store(INV + row_idx, inv, mask=row_ok)
                tl.store(GDEN + row_idx, gden, mask=row_ok)
            gate_grad += tl.where(row_ok, dout_a - dout_local, 0.0)
            if LOCAL_DELTA:
                tl.store(DELTA + h * (tl.num_programs(1) // n_seg) * seqlen + b * seqlen + rows, dout_local,
                         mask=row_ok)  # fmt: skip
        n_c = tl.num_programs(0)
        tl.store(GGATE + (pid_bs.to(tl.int64) * heads + h) * n_c + pid_c, tl.sum(gate_grad, 0))
    if STATE:
        part = pid_c * tl.num_programs(1) * kv_heads + state
        gm_ptrs = GM + (part * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(gm_ptrs, gm, mask=d_ok[:, None] & d_ok[None, :])
        tl.store(GZ + part * HEAD_DIM + offs_d, gz, mask=d_ok)


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
    if pid_n == 0:  # a branch: Triton 3.9's interpreter refuses the mask d_ok & (pid_n == 0)
        tl.store(GZ + state * HEAD_DIM + offs_d, gz, mask=d_ok)


def memory_retrieval(
    q: torch.Tensor,
    local: torch.Tensor,
    gate: torch.Tensor,
    m_before: torch.Tensor,
    z_before: torch.Tensor,
    segment_len: int,
) -> torch.Tensor:
    """gate * sigma(Q) M / (sigma(Q) z) + (1 - gate) * local per segment (module docstring):
    q, local (batch, seqlen, heads, head_dim) -> out, same shape, in q's dtype. On an H100/H200
    with bf16 inputs of head_dim 128, the Hopper kernel (``hopper/infini_retrieval.py``,
    ``dispatch.uses_infini_retrieval``)."""
    q, local = last_dim_contiguous(q), last_dim_contiguous(local)
    b, s, heads, d = q.shape
    n_seg, kv_heads = m_before.shape[1], m_before.shape[2]
    if uses_infini_retrieval(q, local):
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        chunk = row_chunk(min(segment_len, s), b * n_seg * kv_heads, 64)[0]
        hopper_module("infini_retrieval").launch_retrieval(
            q, local, out, m_before.to(torch.bfloat16).contiguous(), z_before.float().contiguous(),
            gate.float().contiguous(), segment_len, chunk,
        )  # fmt: skip
        return out
    out = torch.empty_like(q)
    t = tiles(d, q.dtype, column_tile(d), row_tile(d), "retrieval")
    chunk, chunks = row_chunk(min(segment_len, s), b * n_seg * heads, t["BLOCK_M"])
    _retrieval_kernel[(chunks, b * n_seg, heads)](
        q, local, out, m_before.to(operand_dtype(q.dtype)).contiguous(), z_before.float().contiguous(),
        gate.float().contiguous(), s, n_seg, segment_len, chunk, kv_heads,
        *q.stride()[:3], *local.stride()[:3], *out.stride()[:3], GROUP=heads // kv_heads, **t,
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
    local_delta: torch.Tensor | None = None,
    dq_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``memory_retrieval``: (dq (in ``dq_dtype``, default q's), dlocal, dgate
    (heads,) float32, d m_before, d z_before (float32, m_before's and z_before's shapes)).

    ``local_delta`` (heads, batch * seqlen) float32, contiguous: if given, dlocal = (1 - gate)
    dout is not written (None is returned) and local_delta receives rowsum(dout * local) instead.
    An attention backward run on dout itself, with that delta and its LSE shifted by
    -log(1 - gate) per head, gives the local attention's gradients for dlocal: the shift scales
    its probabilities, and with them every gradient, by 1 - gate.

    With ``local_delta`` and float32 dq, bf16 at head_dim 128 on an sm_90 GPU runs the Hopper
    kernel (``hopper/infini_retrieval.py``, ``dispatch.uses_infini_retrieval_backward``)."""
    q, local, dout = (last_dim_contiguous(t) for t in (q, local, dout))
    b, s, heads, d = q.shape
    n_seg, kv_heads = m_before.shape[1], m_before.shape[2]
    z_before, gate = z_before.float().contiguous(), gate.float().contiguous()
    m = m_before.to(operand_dtype(q.dtype)).contiguous()
    hopper = local_delta is not None and dq_dtype == torch.float32 and uses_infini_retrieval_backward(q, dout)
    dq = torch.empty(q.shape, device=q.device, dtype=dq_dtype or q.dtype)
    dlocal = None if local_delta is not None else torch.empty_like(local)
    t = tiles(d, q.dtype, column_tile(d), 32, "retrieval_backward")
    # All columns in one block: the memory's gradient is summed in the same pass (q and dout
    # read once); wider heads have a separate pass over them. The Hopper kernel takes 128-row
    # steps and sums the gate's gradient per compute warpgroup (two parts).
    one_pass = hopper or t["BLOCK_N"] == t["BLOCK_D"]
    chunk, chunks = row_chunk(min(segment_len, s), b * n_seg * kv_heads, 128 if hopper else t["BLOCK_M"])
    ggate = torch.empty(b * n_seg, heads, chunks, 2 if hopper else 1, device=q.device, dtype=torch.float32)
    state_rows = (chunks,) if one_pass else ()
    gm = torch.empty(*state_rows, *m_before.shape, device=q.device, dtype=torch.float32)
    gz = torch.empty(*state_rows, *z_before.shape, device=q.device, dtype=torch.float32)
    inv = gden = gz
    if not one_pass:
        inv = torch.empty(b, heads, s, device=q.device, dtype=torch.float32)
        gden = torch.empty_like(inv)
    dl = local if dlocal is None else dlocal
    if hopper:
        hopper_module("infini_retrieval").launch_retrieval_backward(
            q, local, dout, m, z_before, gate, local_delta, dq, ggate, gm, gz, segment_len, chunk
        )
    else:
        _retrieval_backward_kernel[(chunks, b * n_seg, kv_heads)](
            q, local, dout, dq, dl, m, z_before, gate, inv, gden, ggate,
            inv if local_delta is None else local_delta, gm, gz, s, n_seg, segment_len, chunk, heads,
            kv_heads,
            *q.stride()[:3], *local.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], *dl.stride()[:3],
            GROUP=heads // kv_heads, LOCAL_DELTA=local_delta is not None, STATE=one_pass, **t,
        )  # fmt: skip
    if one_pass:
        gm, gz = (x[0] if chunks == 1 else x.sum(0) for x in (gm, gz))
    else:
        _retrieval_state_backward_kernel[(b * n_seg, kv_heads, triton.cdiv(d, t["BLOCK_N"]))](
            q, dout, inv, gden, gate, gm, gz, s, n_seg, segment_len, heads, kv_heads,
            *q.stride()[:3], *dout.stride()[:3], GROUP=heads // kv_heads, **t,
        )  # fmt: skip
    return dq, dlocal, ggate.sum((0, 2, 3)), gm, gz
