"""Infini-attention's retrieval (``infini/retrieval.py``) and its backward for Hopper (sm_90) in
Gluon: bf16, head_dim 128; the backward with the local attention's delta and float32 dq (the
single-device path of ``ringflash.infini``).

The retrieval, out = g sigma(q) M / (sigma(q) z) + (1 - g) local, walks (row chunk, segment, kv
head) items as the memory updates' backward does (infini_updates.py): M once per item into one
of two buffers, 64-token blocks of q and local (every query head of the group) through a ring,
the two compute warpgroups on alternate blocks; sigma(q) goes over the q tile as the product's
operand, and a whole block's output over it again, stored by TMA.

The backward:

The Triton kernel holds the memory's gradient (128 x 128 float32) beside a row block's tiles in
255 registers, one program per SM, and moves its bytes at 30% of an H200's bandwidth. Here a
loader warp streams 128-row steps of q and dout by TMA through a two-stage ring, and local a
step ahead through a buffer of its own, while two compute warpgroups take 64 rows each; the
memory's gradient is split by rows between them (64 x 128 each). 2.5 TB/s on an H200, 1.8x
Triton's kernel (docs/experiments.md §41); 2.9 TB/s with the barriers below (§47).

Per step and warpgroup (its 64 tokens t, sigma = ELU + 1, den = sigma(q_t) z, g the head's gate,
scale = g / den, 0 where den is):

    scale_t sigma(q_t) written over q_t in shared memory (bf16)
    dp    = dout_t M^T                                  (two 64-column wgmmas)
    u_t   = rowsum(scale_t sigma(q_t) * dp) = g rowsum(dout_t * A_t),   c_t = u_t / g
    dq_t  = (dp - c_t z^T) min(scale_t sigma(q_t), scale_t)   (scale sigma'(q), sigma' = min(sigma, 1))
    then, over the step's 128 tokens (both warpgroups' tiles):
    dM[its 64 rows] += (scale sigma(q))^T dout,   dz[its 64 rows] -= (scale sigma(q))^T c
    (c as column 0 of an 8-column tile)

with scale sigma(q_t) read back from shared memory where it is needed, and rowsum(dout_t *
local_t), the local attention backward's delta, from dout as it came. The gate's gradient is
the sum of u / g (0 for a gate of exactly 0, a sigmoid below -103, whose chain rule to beta
multiplies by g (1 - g) = 0 anyway) less that of rowsum(dout * local). Scaling sigma(q) rather
than dout leaves the streamed dout tiles unwritten (a tile store less per step) and
halves dq's error against float64 (docs/experiments.md §51). The outputs are those of
``retrieval._retrieval_backward_kernel`` with STATE and LOCAL_DELTA.

A warpgroup arrives at a named barrier of its own once its tiles of the step are written, stores
its dq, and then waits for the other's (``TILES_READY``): where both synced on one barrier
before dq, the warps spent a third of their cycles waiting there (Nsight Compute), and the
kernel took 4.29 ms against 3.70 now (1M tokens, 8 heads, segment 2048, one H200).

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import named_barriers
from .gluon_api import tma
from .infini_updates import (  # the shapes and register budgets of every Infini kernel
    BLOCK_T,
    COMPUTE_REGS,
    HALF,
    HEAD_DIM,
    LOADER_REGS,
    MAX_REGISTERS,
    allocate_stream,
    await_item_matrix,
    block_layout,
    inverse,
    matrix_descriptor,
    sigma,
    store_block,
    stream_loader,
    token_descriptor,
)
from .infini_updates import STAGES as FWD_STAGES
from .tma import make_context_current, shared_layout

BLOCK_M = gl.constexpr(128)  # rows per step of the backward
STAGES = gl.constexpr(2)  # the backward's ring
# Warpgroup w's tiles of a step (scale sigma(q), c) written: it arrives at barrier
# TILES_READY + 2 * w + j % 2 of step j and the other warpgroup syncs there before its products
# over the step's 128 tokens. Two per warpgroup, alternating between steps: a warpgroup can
# arrive at step j + 1 before the other has synced at step j, never at step j + 2 (that needs
# the other's arrival at j + 1, which comes after its sync at j).
TILES_READY = named_barriers.FIRST_ID


@gluon.jit
def _sigma_tile(tile, ok, layout: gl.constexpr):
    """sigma of a shared 64 x 64 tile of q in float32, 0 in rows past the chunk (sigma(0) is 1)."""
    return gl.where(ok[:, None], sigma(tile.load(layout).to(gl.float32)), 0.0)


@gluon.jit
def _fwd_compute(
    q_smem, lo_smem, m_smem, ready, empty, m_ready, m_empty, out_desc, OUT, Z, GATE, seqlen, n_seg,
    segment_len, kv_heads, group, chunk, n_chunks, out_batch_rows, n_items, stride_ob, stride_os, stride_oh,
    w: gl.constexpr,
):  # fmt: skip
    """Compute warpgroup w: the blocks j of the program with j % 2 == w."""
    dtype: gl.constexpr = q_smem.dtype
    acc_l: gl.constexpr = block_layout(HEAD_DIM)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_l))
    zero = gl.zeros([BLOCK_T, HEAD_DIM], gl.float32, acc_l)
    i = 0
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        args = (seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks)
        state, b, kvh, lo, hi, m = await_item_matrix(item, i, m_smem, m_ready, *args)
        for g in range(group):
            h = kvh * group + g
            gate = gl.load(GATE + h)
            for t in range(lo, hi, BLOCK_T):
                if j % 2 == w:
                    s = j % FWD_STAGES
                    mbarrier.wait(ready.index(s), (j // FWD_STAGES) & 1)
                    q_tile = q_smem.index(s)
                    x = q_tile.load(acc_l).to(gl.float32)
                    x = sigma(x)
                    den = gl.sum(x * gl.load(Z + state.to(gl.int64) * HEAD_DIM + cols)[None, :], 1)
                    q_tile.store(x.to(dtype))  # each thread rewrites what it read
                    fence_async_shared()
                    num = warpgroup_mma(q_tile, m, zero, use_acc=False, is_async=True)
                    num = warpgroup_mma_wait(0, deps=(num,))
                    scale = gate * inverse(den)
                    local = lo_smem.index(s).load(acc_l).to(gl.float32)
                    out = num * scale[:, None] + (1.0 - gate) * local
                    store_block(out_desc, q_tile, out, OUT, b, h, t, hi, out_batch_rows, stride_ob, stride_os,
                                stride_oh)  # fmt: skip
                    tma.store_wait(0)  # the tile read: the stage can be reloaded
                    mbarrier.arrive(empty.index(s), count=1)
                j += 1
        mbarrier.arrive(m_empty.index(i % 2), count=1)
        i += 1


@gluon.jit
def allocate_memory_barriers():
    """The mbarriers of the attention forward's memory buffers (hopper/forward.py's MEMORY): [0]
    loaded, [1] released by both compute warpgroups."""
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=2)
    return bars


@gluon.jit
def load_memory(m_desc, Z, state, bars, m_smem, z_smem, k):
    """The forward's loader warp: M of ``state`` into ``m_smem`` by TMA and its z (float32 at Z)
    into ``z_smem`` for the program's k-th query tile, once both warpgroups are done with the
    (k-1)-th's. z passes through the warp's registers, written before the arrive that
    completes with M's bytes (an arrive releases the warp's writes to the waiting warps)."""
    mbarrier.wait(bars.index(1), (k & 1) ^ 1)  # mbarriers start in phase 1 complete
    layout: gl.constexpr = gl.BlockedLayout([HEAD_DIM // 32], [32], [1], [0])
    z_smem.store(gl.load(Z + state.to(gl.int64) * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=layout)))
    mbarrier.expect(bars.index(0), m_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(m_desc, [state * HEAD_DIM, 0], bars.index(0), m_smem)


@gluon.jit
def retrieve_rows(q_s, local, m_smem, z_smem, bars, GATE, head, k, o_desc, out_desc, row, whole):
    """The retrieval in the attention forward's epilogue (hopper/forward.py's MEMORY) for a
    warpgroup's 64 rows of its k-th query tile: g sigma(q) M / (sigma(q) z) + (1 - g) local,
    with q's rows from their Q stage (``q_s``), local (float32, the MMA accumulator's layout)
    the normalized attention output, M and z in ``m_smem`` and ``z_smem`` (``bars``), the gate
    from GATE (head's). The product takes (g / den) sigma(q) from registers and (1 - g) local as
    its accumulator (rows with den = 0 retrieve 0, as ``_fwd_compute``'s).

    With ``whole`` (all 64 rows in the sequence) local and then the result go out through the Q
    stage by TMA, to ``o_desc`` and ``out_desc`` at ``row`` and the head's columns: st.global
    from the accumulator's layout writes 16 of each 32-byte sector per instruction, and two
    outputs so stored held the warps on their store queue (Nsight Compute). Else the caller
    stores both with masks. Returns the result."""
    layout: gl.constexpr = local.type.layout
    x = sigma(q_s.load(layout).to(gl.float32))
    if whole:  # each thread rewrites the elements it read
        q_s.store(local.to(q_s.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row, head * HEAD_DIM], q_s)
    mbarrier.wait(bars.index(0), k & 1)
    z = z_smem.load(gl.SliceLayout(0, layout))
    den = gl.sum(x * z[None, :], 1)
    gate = gl.load(GATE + head)
    x = x * (gate * inverse(den))[:, None]
    x_op = gl.convert_layout(x.to(q_s.dtype), gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2))
    out = warpgroup_mma(x_op, m_smem, local * (1.0 - gate), is_async=True)
    out = warpgroup_mma_wait(0, deps=(out,))
    mbarrier.arrive(bars.index(1), count=1)
    if whole:
        tma.store_wait(0)  # local read out of the stage
        q_s.store(out.to(q_s.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, head * HEAD_DIM], q_s)
        tma.store_wait(0)  # before the stage goes back to the loader
    return out


@gluon.jit
def retrieval_kernel(
    q_desc, lo_desc, out_desc, m_desc, OUT, Z, GATE, seqlen, n_seg, segment_len, kv_heads, group, chunk,
    n_chunks, q_batch_rows, lo_batch_rows, out_batch_rows, n_items, stride_ob, stride_os, stride_oh,
):  # fmt: skip
    q_smem, lo_smem, m_smem, ready, empty, m_ready, m_empty = allocate_stream(q_desc, lo_desc, m_desc)
    # fmt: off
    gl.warp_specialize(
        [
            (_fwd_compute, (q_smem, lo_smem, m_smem, ready, empty, m_ready, m_empty, out_desc, OUT, Z, GATE,
                            seqlen, n_seg, segment_len, kv_heads, group, chunk, n_chunks, out_batch_rows,
                            n_items, stride_ob, stride_os, stride_oh, 0)),
            (_fwd_compute, (q_smem, lo_smem, m_smem, ready, empty, m_ready, m_empty, out_desc, OUT, Z, GATE,
                            seqlen, n_seg, segment_len, kv_heads, group, chunk, n_chunks, out_batch_rows,
                            n_items, stride_ob, stride_os, stride_oh, 1)),
            (stream_loader, (q_desc, lo_desc, m_desc, q_smem, lo_smem, m_smem, ready, empty, m_ready, m_empty,
                             seqlen, n_seg, segment_len, kv_heads, group, chunk, n_chunks, q_batch_rows,
                             lo_batch_rows, n_items, True)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


def launch_retrieval(
    q: torch.Tensor,
    local: torch.Tensor,
    out: torch.Tensor,
    m_before: torch.Tensor,
    z_before: torch.Tensor,
    gate: torch.Tensor,
    segment_len: int,
    chunk: int,
) -> None:
    """Write ``retrieval.memory_retrieval``'s out: q, local, out (batch, seqlen, heads, 128) bf16
    in layouts ``dispatch.uses_infini_retrieval`` accepts; m_before bf16 and
    z_before, gate float32, contiguous; ``chunk`` rows per item, a multiple of 64."""
    b, s, heads, _ = q.shape
    n_seg, kv_heads = m_before.shape[1], m_before.shape[2]
    n_chunks = -(-min(segment_len, s) // chunk)
    n_items = b * n_seg * kv_heads * n_chunks
    (qd, q_rows), (ld, lo_rows), (od, out_rows) = (token_descriptor(t, 128) for t in (q, local, out))
    programs = min(n_items, torch.cuda.get_device_properties(q.device).multi_processor_count)
    retrieval_kernel[(programs,)](
        qd, ld, od, matrix_descriptor(m_before), out, z_before, gate, s, n_seg, segment_len, kv_heads,
        heads // kv_heads, chunk, n_chunks, q_rows, lo_rows, out_rows, n_items, *out.stride()[:3],
        num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip


@gluon.jit
def _loader(
    q_desc, do_desc, m_desc, lo_desc, q_smem, do_smem, m_smem, lo_smem, ready, empty, lo_ready, lo_empty,
    m_bar, row0, m_row0, kvh, n_tiles, group,
):  # fmt: skip
    """M once, then per (query head of the group, 128-row step) the step's q (four 64 x 64
    tiles) and dout (two 64 x 128) into ring stage j % STAGES, and its local (two 64 x 128) into
    the one local buffer once the last step's is read (a step ahead of the compute)."""
    mbarrier.expect(m_bar, 2 * m_desc.block_type.nbytes)
    for r in gl.static_range(2):
        tma.async_copy_global_to_shared(m_desc, [m_row0 + r * HALF, 0], m_bar, m_smem.index(r))
    step_bytes: gl.constexpr = 4 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes
    for g in range(group):
        col = (kvh * group + g) * HEAD_DIM
        for i in range(n_tiles):
            j = g * n_tiles + i
            s = j % STAGES
            # mbarriers start in phase 1 complete: the first wait on each empty stage passes.
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, step_bytes)
            row = row0 + i * BLOCK_M
            for t in gl.static_range(2):
                for c in gl.static_range(2):
                    tma.async_copy_global_to_shared(
                        q_desc, [row + t * HALF, col + c * HALF], bar, q_smem.index((s * 2 + t) * 2 + c)
                    )
                tma.async_copy_global_to_shared(do_desc, [row + t * HALF, col], bar, do_smem.index(s * 2 + t))
            mbarrier.wait(lo_empty, (j & 1) ^ 1)
            mbarrier.expect(lo_ready, 2 * lo_desc.block_type.nbytes)
            for t in gl.static_range(2):
                tma.async_copy_global_to_shared(lo_desc, [row + t * HALF, col], lo_ready, lo_smem.index(t))


@gluon.jit
def _store_dq(DQ, value, b, h, r0, col, hi, stride_b, stride_s, stride_h):
    """A warpgroup's (64, 64) float32 half of dq at rows [r0, r0 + 64) of batch row b, columns
    col of head h, rows from ``hi`` on masked. Both halves share one offset tensor: with one per
    half the build hoisted both (64-bit, out of the loop) and spilled 270 registers per step;
    through shared memory by TMA instead it ran at the same speed (docs/experiments.md §44)."""
    layout: gl.constexpr = value.type.layout
    rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    offs = rows.to(gl.int64)[:, None] * stride_s + cols[None, :]
    ptr = DQ + (b.to(gl.int64) * stride_b + h * stride_h + col)
    gl.store(ptr + offs, value, mask=(rows < hi)[:, None])


@gluon.jit
def _compute(
    q_smem, do_smem, m_smem, da_smem, lo_smem, ready, empty, lo_ready, lo_empty, m_bar, DQ, Z, GATE, GGATE,
    DELTA, GM, GZ, b, lo, hi, n_tiles, kvh, state, n_states, pid_c, n_c, pid_bs, seqlen, heads, batch,
    stride_dqb, stride_dqs, stride_dqh,
    group, w: gl.constexpr, LOCAL_DELTA: gl.constexpr,
):  # fmt: skip
    """Compute warpgroup w: rows w * 64 of every step; rows d1 in [w * 64, w * 64 + 64) of dM."""
    dtype: gl.constexpr = q_smem.dtype
    half_l: gl.constexpr = block_layout(HALF)
    full_l: gl.constexpr = block_layout(HEAD_DIM)
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte loads of local
    rows_l: gl.constexpr = gl.SliceLayout(1, half_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, half_l)
    # z's gradient, sum over tokens of sigma(q) d den = -wq^T rowsum(dout * A), as a product
    # beside the memory's: rowsum(dout * A) goes to shared memory as column 0 of an 8-column
    # tile. Summed over rows in registers it took a cross-warp reduction and barrier per step.
    da_l: gl.constexpr = block_layout(8)
    da_cols = gl.arange(0, 8, layout=gl.SliceLayout(0, da_l))
    gz = gl.zeros([HALF, 8], gl.float32, da_l)
    cols = gl.arange(0, HALF, layout=cols_l)
    z0 = gl.load(Z + state * HEAD_DIM + cols)
    z1 = gl.load(Z + state * HEAD_DIM + HALF + cols)
    gm = gl.zeros([HALF, HEAD_DIM], gl.float32, full_l)
    t_rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, tile_l))
    mbarrier.wait(m_bar, 0)
    for g in range(group):
        h = kvh * group + g
        gate = gl.load(GATE + h)
        inv_gate = inverse(gate)
        # the gate's gradient: the sum of rowsum(dout * A) minus that of rowsum(dout * local)
        u_sum = gl.zeros([HALF], gl.float32, rows_l)
        dout_local_sum = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, tile_l))
        for i in range(n_tiles):
            j = g * n_tiles + i
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            r0 = lo + i * BLOCK_M + w * HALF
            do_s = do_smem.index(s * 2 + w)
            rows = r0 + gl.arange(0, HALF, layout=rows_l)
            ok = rows < hi
            # scale sigma(q), scale = gate / den (0 where den is), over the warpgroup's own q
            # tiles of the stage (each thread rewriting what it read): the memory's gradient is
            # (scale sigma(q))^T dout with dout as it came, u below takes the scale with it, and
            # min(scale sigma, scale) is scale sigma'(q). The stage is not reloaded before both
            # warpgroups' products retire.
            q_s0 = q_smem.index((s * 2 + w) * 2)
            q_s1 = q_smem.index((s * 2 + w) * 2 + 1)
            x0 = _sigma_tile(q_s0, ok, half_l)
            x1 = _sigma_tile(q_s1, ok, half_l)
            scale = gate * inverse(gl.sum(x0 * z0[None, :], 1) + gl.sum(x1 * z1[None, :], 1))
            q_s0.store((x0 * scale[:, None]).to(dtype))
            q_s1.store((x1 * scale[:, None]).to(dtype))
            # rowsum(dout * local), the local attention backward's delta
            t_ok = (r0 + t_rows) < hi
            mbarrier.wait(lo_ready, j & 1)
            dout = do_s.load(tile_l).to(gl.float32)
            dout_local = gl.sum(dout * lo_smem.index(w).load(tile_l).to(gl.float32), 1)
            # The loader's next TMA write into the buffer (async proxy) waits on this release:
            # without a proxy fence after the reads, a step's first rows read the next step's
            # local in about 1 run of 300 (2048-token segments, one program each).
            fence_async_shared()
            mbarrier.arrive(lo_empty, count=1)
            dout_local = gl.where(t_ok, dout_local, 0.0)
            dout_local_sum += dout_local
            if LOCAL_DELTA:
                gl.store(DELTA + h * (batch * seqlen) + b * seqlen + r0 + t_rows, dout_local, mask=t_ok)
            zero = gl.zeros([HALF, HALF], gl.float32, half_l)
            dp0 = warpgroup_mma(do_s, m_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
            dp1 = warpgroup_mma(do_s, m_smem.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
            dp0, dp1 = warpgroup_mma_wait(0, deps=(dp0, dp1))  # dout M^T
            # u = rowsum(scale sigma(q) * dout M^T) = gate rowsum(dout * A)
            u = gl.sum(q_s0.load(half_l).to(gl.float32) * dp0, 1)
            u += gl.sum(q_s1.load(half_l).to(gl.float32) * dp1, 1)
            # c = u / gate = rowsum(dout * A): dq = scale (dout M^T - c z / den) sigma'(q)
            # = (dout M^T - c z) min(scale sigma, scale) as scale = gate / den; z's gradient
            # -sigma(q)^T (scale c / den) = -(scale sigma(q))^T c
            c = u * inv_gate
            da = gl.convert_layout(c, gl.SliceLayout(1, da_l))
            # by step parity: the other warpgroup's product may still read step j - 1's
            da_smem.index((j % 2) * 2 + w).store(gl.where(da_cols[None, :] == 0, da[:, None], 0.0).to(dtype))
            fence_async_shared()
            # The other warpgroup may take this step's tiles; dq is stored while it catches up
            # (every step arrives: the predicate is always true).
            named_barriers.arrive(TILES_READY + 2 * w + j % 2, 256, j >= 0)
            x = q_s1.load(half_l).to(gl.float32)
            dq = (dp1 - c[:, None] * z1[None, :]) * gl.minimum(x, scale[:, None])  # scale sigma'(q)
            _store_dq(DQ, dq, b, h, r0, HALF, hi, stride_dqb, stride_dqs, stride_dqh)
            x = q_s0.load(half_l).to(gl.float32)
            dq = (dp0 - c[:, None] * z0[None, :]) * gl.minimum(x, scale[:, None])
            _store_dq(DQ, dq, b, h, r0, 0, hi, stride_dqb, stride_dqs, stride_dqh)
            u_sum += gl.where(ok, u, 0.0)
            named_barriers.sync(TILES_READY + 2 * (1 - w) + j % 2, 256)
            for t in gl.static_range(2):  # token half t: wq tile (t, d half w), dout tile t
                wq_t = q_smem.index((s * 2 + t) * 2 + w).permute((1, 0))
                gm = warpgroup_mma(wq_t, do_smem.index(s * 2 + t), gm, is_async=True)
                gz = warpgroup_mma(wq_t, da_smem.index((j % 2) * 2 + t), gz, is_async=True)
            gm, gz = warpgroup_mma_wait(0, deps=(gm, gz))
            mbarrier.arrive(empty.index(s), count=1)
        gate_grad = gl.sum(u_sum, 0) * inv_gate - gl.sum(dout_local_sum, 0)
        gl.store(GGATE + ((pid_bs * heads + h) * n_c + pid_c) * 2 + w, gate_grad)
    g_rows = w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, full_l))
    g_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, full_l))
    part = pid_c * n_states + state
    gl.store(GM + (part * HEAD_DIM + g_rows.to(gl.int64)[:, None]) * HEAD_DIM + g_cols[None, :], gm)
    gz_off = (pid_c * n_states + state) * HEAD_DIM
    gz = -gl.sum(gl.where(da_cols[None, :] == 0, gz, 0.0), 1)
    gl.store(GZ + gz_off + w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, da_l)), gz)


@gluon.jit
def retrieval_backward_kernel(
    q_desc, do_desc, m_desc, lo_desc, DQ, Z, GATE, GGATE, DELTA, GM, GZ,
    seqlen, n_seg, segment_len, chunk, heads, kv_heads, batch_rows, stride_dqb, stride_dqs, stride_dqh,
    LOCAL_DELTA: gl.constexpr,
):  # fmt: skip
    """One (row chunk, segment, kv head), as the Triton kernel's grid. The query heads of a kv
    head are a runtime loop: with a constant group of 1 the build gave the second warpgroup
    wrong dq (docs/experiments.md §41), builds with a loop gave the Triton kernel's results."""
    pid_c = gl.program_id(0)
    pid_bs = gl.program_id(1)
    kvh = gl.program_id(2)
    b = pid_bs // n_seg
    start = (pid_bs % n_seg) * segment_len
    lo = start + pid_c * chunk
    hi = gl.minimum(gl.minimum(lo + chunk, start + segment_len), seqlen)
    n_tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_M), 0)
    n_states = gl.num_programs(1) * kv_heads
    state = pid_bs * kv_heads + kvh
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES * 4, HALF, HALF], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, HALF, HEAD_DIM], do_desc.layout)
    m_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], m_desc.layout)
    da_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, 8], dtype)
    da_smem = gl.allocate_shared_memory(dtype, [4, HALF, 8], da_layout)  # (step parity, warpgroup)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    m_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    lo_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], lo_desc.layout)
    lo_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ready, empty
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both compute warpgroups release a stage
    mbarrier.init(m_bar.index(0), count=1)
    mbarrier.init(lo_bars.index(0), count=1)
    mbarrier.init(lo_bars.index(1), count=2)  # both compute warpgroups read their half
    batch = gl.num_programs(1) // n_seg
    group = heads // kv_heads
    # fmt: off
    gl.warp_specialize(
        [
            (_compute, (q_smem, do_smem, m_smem, da_smem, lo_smem, ready, empty, lo_bars.index(0),
                        lo_bars.index(1), m_bar.index(0), DQ, Z, GATE, GGATE, DELTA, GM, GZ, b, lo, hi,
                        n_tiles, kvh, state, n_states, pid_c, gl.num_programs(0), pid_bs, seqlen, heads,
                        batch, stride_dqb, stride_dqs, stride_dqh, group, 0, LOCAL_DELTA)),
            (_compute, (q_smem, do_smem, m_smem, da_smem, lo_smem, ready, empty, lo_bars.index(0),
                        lo_bars.index(1), m_bar.index(0), DQ, Z, GATE, GGATE, DELTA, GM, GZ, b, lo, hi,
                        n_tiles, kvh, state, n_states, pid_c, gl.num_programs(0), pid_bs, seqlen, heads,
                        batch, stride_dqb, stride_dqs, stride_dqh, group, 1, LOCAL_DELTA)),
            (_loader, (q_desc, do_desc, m_desc, lo_desc, q_smem, do_smem, m_smem, lo_smem, ready, empty,
                       lo_bars.index(0), lo_bars.index(1), m_bar.index(0), b * batch_rows + lo,
                       state * HEAD_DIM, kvh, n_tiles, group)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


def descriptors(q: torch.Tensor, dout: torch.Tensor, m_before: torch.Tensor, local: torch.Tensor) -> tuple:
    """TMA descriptors of q, dout, local (batch, seqlen, heads, 128) bf16, contiguous, as (rows,
    heads * 128) with 64 x 64 (q) and 64 x 128 blocks, and of the bf16 memories (..., 128, 128) as
    rows of 128."""
    make_context_current(q.device)
    b, s, heads, d = q.shape
    q_layout = shared_layout((HALF.value, HALF.value), gl.bfloat16)
    row_layout = shared_layout((HALF.value, d), gl.bfloat16)
    rows = b * s
    qd = TensorDescriptor(q, [rows, heads * d], [heads * d, 1], [HALF.value, HALF.value], q_layout)
    dd = TensorDescriptor(dout, [rows, heads * d], [heads * d, 1], [HALF.value, d], row_layout)
    md = TensorDescriptor(m_before, [m_before.numel() // d, d], [d, 1], [HALF.value, d], row_layout)
    ld = TensorDescriptor(local, [rows, heads * d], [heads * d, 1], [HALF.value, d], row_layout)
    return qd, dd, md, ld


def launch_retrieval_backward(
    q: torch.Tensor,
    local: torch.Tensor,
    dout: torch.Tensor,
    m_before: torch.Tensor,
    z_before: torch.Tensor,
    gate: torch.Tensor,
    local_delta: torch.Tensor,
    dq: torch.Tensor,
    ggate: torch.Tensor,
    gm: torch.Tensor,
    gz: torch.Tensor,
    segment_len: int,
    chunk: int,
) -> None:
    """Run the kernel for ``retrieval.memory_retrieval_backward``, which allocates and sums the
    outputs: q, dout (batch, seqlen, heads, 128) bf16, contiguous (``dispatch``); local of q's
    shape; m_before bf16 and z_before, gate float32, contiguous; dq float32 (q's shape);
    ggate (batch * segments, heads, chunks, 2), one part per compute warpgroup; gm, gz (chunks,
    m_before's and z_before's shapes) float32; ``chunk`` rows per program, a multiple of 128."""
    b, s, heads, d = q.shape
    n_seg, kv_heads = m_before.shape[1], m_before.shape[2]
    local = local.to(torch.bfloat16).contiguous()
    retrieval_backward_kernel[(gm.shape[0], b * n_seg, kv_heads)](
        *descriptors(q, dout, m_before, local), dq, z_before, gate, ggate, local_delta, gm, gz, s, n_seg,
        segment_len, chunk, heads, kv_heads, s, *dq.stride()[:3],
        LOCAL_DELTA=True, num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
