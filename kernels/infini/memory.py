"""Infini-attention's compressive memory on segments: the per-segment updates, the scan over
segments that turns them into the memory before each segment, and their backward, as Triton
kernels (the retrieval is in ``retrieval.py``).

With sigma(x) = ELU(x) + 1 (x + 1 above 0, exp(x) below), for segment s of a batch row and key/value
head:

    update:  dM_s = sigma(K_s)^T V_s  (head_dim x head_dim),   dz_s = sum over tokens of sigma(K_s)
    scan:    M_s = M_in + sum of dM over the segments before s,  the same for z
    Gram:    A_s = sigma(K_s)^T diag(w) sigma(K_s), w = 1 / (sigma(K_s) z_s)  (the delta rule's,
             ``delta.py``: the update kernel and its backward with GRAM)

sigma and the casts stay in registers; the head_dim x head_dim products run on tensor cores with
bf16 operands and float32 accumulation for bf16 inputs, and with float32 operands otherwise
(exact for float32, TF32 for float16, whose inputs carry no more bits). Sums over segments are
float32; the matrices that only feed products (the retrieval's M, the updates' backward's dM
gradient, the delta rule's A_s and S) are written as the products' operand dtype
(``operand_dtype``): bf16 for bf16 inputs.

Tensors: k, v (batch, seqlen, kv_heads, head_dim) with a contiguous last dim; per-segment
states (batch, segments, kv_heads, head_dim[, head_dim]), contiguous. Segment s covers tokens
[s * segment_len, min((s + 1) * segment_len, seqlen)). Kernels that read a state once per
program and then stream tokens take a chunk of a segment's rows per program (``row_chunk``), so
the state is read from L2 once per chunk instead of once per row block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import block_d
from ..hopper.dispatch import hopper_module, uses_infini_updates


@triton.jit
def _sigma(x):
    """ELU + 1, e^x as 2^(x log2 e): ptxas builds tl.exp's ex2 with a guard for results below
    2^-126 (three more instructions per element; the flushed results are below 1e-38)."""
    return tl.where(x > 0, x + 1.0, tl.exp2(x * 1.4426950408889634))


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
def _inverse(den):
    """1 / den, and 0 where den = 0 (an empty memory, z = 0, retrieves nothing)."""
    return tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)


@triton.jit
def _update_kernel(
    K, V, Z, DM, DZ, seqlen, n_seg, segment_len, kv_heads,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM: tl.constexpr,
):  # fmt: skip
    """One (segment, kv head, column block): dM_s[:, cols] and (column block 0) dz_s. With GRAM
    (the delta rule's A_s, ``delta.py``), V is k and the values are w sigma(K)[:, cols] with
    w = 1 / (sigma(K) z_s) from Z, z before each segment; dz is not written."""
    pid_bs = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    pid_n = tl.program_id(2)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    state = pid_bs.to(tl.int64) * kv_heads + h
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    if GRAM:
        z = tl.load(Z + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dz = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_M):
        rows = t0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        keys = _load_sigma(k_base, rows, row_ok, offs_d, stride_ks, HEAD_DIM)
        if GRAM:
            w = _inverse(tl.sum(keys * z[None, :], 1))
            v = _load_sigma(v_base, rows, row_ok, cols, stride_vs, HEAD_DIM) * w[:, None]
        else:
            vmask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
            v_ptrs = v_base + rows[:, None].to(tl.int64) * stride_vs + cols[None, :]
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
            dz += tl.sum(keys, 0)
        acc = _dot(tl.trans(keys), v, acc, LOW_PRECISION, DOT_PRECISION)
    dm_ptrs = DM + (state * HEAD_DIM + offs_d[:, None]) * HEAD_DIM + cols[None, :]
    tl.store(dm_ptrs, acc.to(DM.dtype.element_ty), mask=d_ok[:, None] & (cols[None, :] < HEAD_DIM))
    # dz once per (segment, head): a branch, not a mask ``d_ok & (pid_n == 0)``, which Triton
    # 3.9's interpreter turns into int32 and refuses.
    if not GRAM:
        if pid_n == 0:
            tl.store(DZ + state * HEAD_DIM + offs_d, dz, mask=d_ok)


@triton.jit
def _normalizer_update_kernel(
    K, DZ, seqlen, n_seg, segment_len, kv_heads, stride_kb, stride_ks, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """One (segment, kv head): dz_s = the sum of sigma(K_s) over the segment's tokens, float32."""
    pid_bs = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + b * stride_kb + h * stride_kh
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_M):
        rows = t0 + tl.arange(0, BLOCK_M)
        acc += _load_sigma(k_base, rows, rows < end, offs_d, stride_ks, HEAD_DIM)
    dz = tl.sum(acc, 0)
    tl.store(DZ + (pid_bs.to(tl.int64) * kv_heads + h) * HEAD_DIM + offs_d, dz, mask=offs_d < HEAD_DIM)


@triton.jit
def _row_chunk(pid_c, pid_bs, n_seg, segment_len, chunk, seqlen):
    """(batch row as int64, first token, end token) of chunk pid_c of segment pid_bs % n_seg."""
    b, start, end = _segment(pid_bs, n_seg, segment_len, seqlen)
    lo = start + pid_c * chunk
    return b, lo, tl.minimum(lo + chunk, end)


@triton.jit
def _load_state(base, rows, cols, HEAD_DIM: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """A (rows, cols) tile of a head_dim x head_dim state at ``base`` as a matmul operand."""
    mask = (rows[:, None] < HEAD_DIM) & (cols[None, :] < HEAD_DIM)
    x = tl.load(base + rows[:, None] * HEAD_DIM + cols[None, :], mask=mask, other=0.0)
    return _operand(x, LOW_PRECISION)


@triton.jit
def _update_backward_kernel(
    K, V, GDM, GDZ, DK, DV, S, Z, GZ_PART, seqlen, n_seg, segment_len, chunk, kv_heads,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    LOW_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM: tl.constexpr,
    DEN_ONLY: tl.constexpr,
):  # fmt: skip
    """One (row chunk, segment, kv head): dV = sigma(K) gdM, dK = (V gdM^T + gdz) sigma'(K).
    With one column block the gradient gdM is read once, before the rows.

    GRAM adds the gradient of the delta rule's A_s = sigma(K)^T diag(w) sigma(K), w = 1 / den,
    den = sigma(K) z_s (``delta.py``), given S = dA_s + dA_s^T: dK += (w P + dden z_s^T) sigma'(K)
    with P = sigma(K) S and dden = -w^2 rowsum(P * sigma(K)) / 2. DEN_ONLY computes only z_s's
    gradient from den, sigma(K)^T dden, into GZ_PART (one part per row chunk): the gdz that the
    full pass needs includes it."""
    pid_c = tl.program_id(0)
    pid_bs = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    b, lo, hi = _row_chunk(pid_c, pid_bs, n_seg, segment_len, chunk, seqlen)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    state = pid_bs.to(tl.int64) * kv_heads + h
    gm_base = GDM + state * HEAD_DIM * HEAD_DIM
    s_base = S + state * HEAD_DIM * HEAD_DIM
    k_base = K + b * stride_kb + h * stride_kh
    if not DEN_ONLY:
        gz = tl.load(GDZ + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        if BLOCK_N == BLOCK_D:
            gm_all = _load_state(gm_base, offs_d, offs_d, HEAD_DIM, LOW_PRECISION)
    if GRAM:
        z = tl.load(Z + state * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        gz_den = tl.zeros((BLOCK_D,), dtype=tl.float32)
        if BLOCK_N == BLOCK_D:
            s_all = _load_state(s_base, offs_d, offs_d, HEAD_DIM, LOW_PRECISION)
    for t0 in range(lo, hi, BLOCK_M):
        rows = t0 + tl.arange(0, BLOCK_M)
        row_ok = rows < hi
        rows64 = rows[:, None].to(tl.int64)
        keys = _load_sigma(k_base, rows, row_ok, offs_d, stride_ks, HEAD_DIM)
        keys_op = _operand(keys, LOW_PRECISION)
        dkeys = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        if GRAM:
            # P = sigma(K) S, its contraction split into the column blocks below
            for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                if BLOCK_N == BLOCK_D:
                    dkeys = _dot(keys_op, s_all, dkeys, LOW_PRECISION, DOT_PRECISION)
                else:
                    keys_n = _load_sigma(k_base, rows, row_ok, cols, stride_ks, HEAD_DIM)
                    s_n = _load_state(s_base, cols, offs_d, HEAD_DIM, LOW_PRECISION)
                    dkeys = _dot(keys_n, s_n, dkeys, LOW_PRECISION, DOT_PRECISION)
            w = _inverse(tl.sum(keys * z[None, :], 1))
            dden = -0.5 * w * w * tl.sum(dkeys * keys, 1)
            if DEN_ONLY:
                gz_den += tl.sum(keys * dden[:, None], 0)
            else:
                dkeys = dkeys * w[:, None] + dden[:, None] * z[None, :]
        if not DEN_ONLY:
            dkeys += gz[None, :]
            for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                col_ok = cols < HEAD_DIM
                if BLOCK_N == BLOCK_D:
                    gm = gm_all
                else:
                    gm = _load_state(gm_base, offs_d, cols, HEAD_DIM, LOW_PRECISION)
                vmask = row_ok[:, None] & col_ok[None, :]
                v_ptrs = V + b * stride_vb + h * stride_vh + rows64 * stride_vs + cols[None, :]
                v = tl.load(v_ptrs, mask=vmask, other=0.0)
                zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                dv = _dot(keys_op, gm, zero, LOW_PRECISION, DOT_PRECISION)
                dv_ptrs = DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvs + cols[None, :]
                tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=vmask)
                dkeys = _dot(v, tl.trans(gm), dkeys, LOW_PRECISION, DOT_PRECISION)
            dk = dkeys * _sigma_grad(keys)
            dk_ptrs = DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dks + offs_d[None, :]
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if DEN_ONLY:
        parts = tl.num_programs(1) * kv_heads
        tl.store(GZ_PART + (pid_c * parts + state) * HEAD_DIM + offs_d, gz_den, mask=d_ok)


@triton.jit
def _scan_kernel(
    UPD, INIT, BEFORE, TOTAL, n_seg, kv_heads, width,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One (batch row, kv head, block of the flattened state): BEFORE[s] = INIT + the sum of UPD
    over the segments before s (after s with REVERSE), TOTAL = INIT + the sum over all, in
    float32. SEGMENTS segments are loaded at once and summed with a cumulative sum along them."""
    pid = tl.program_id(0).to(tl.int64)
    b, h = pid // kv_heads, pid % kv_heads
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    if HAS_INIT:
        acc = tl.load(INIT + pid * width + offs, mask=ok, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s0 in range(0, n_seg, SEGMENTS):
        steps = s0 + tl.arange(0, SEGMENTS)
        if REVERSE:
            segs = n_seg - 1 - steps
        else:
            segs = steps
        mask = (steps < n_seg)[:, None] & ok[None, :]
        ptrs = ((b * n_seg + segs[:, None]) * kv_heads + h) * width + offs[None, :]
        upd = tl.load(UPD + ptrs, mask=mask, other=0.0).to(tl.float32)
        inclusive = tl.cumsum(upd, 0)
        tl.store(BEFORE + ptrs, (acc[None, :] + inclusive - upd).to(BEFORE.dtype.element_ty), mask=mask)
        acc += tl.sum(upd, 0)
    tl.store(TOTAL + pid * width + offs, acc, mask=ok)


# Tiles, from the registers and spills of the sm_90 builds (bf16, head_dim 128, 8 warps,
# kernels/offline_compile.py). The updates are per-segment sums with a column-block grid axis:
# 64 columns keep their float32 accumulator at 128 x 64; all columns at once (254 registers, no
# spill, k read once instead of twice) when there are at least WIDE_STATE_PROGRAMS (segment,
# head) programs to fill the GPU. Kernels that stream rows take a chunk of a segment per program,
# as long as there stay CHUNK_PROGRAMS programs.
WIDE_STATE_PROGRAMS = 256
CHUNK_PROGRAMS = 512
# The delta rule's gradient passes also hold S (head_dim x head_dim) and sigma(K) S: 32 rows (255
# registers, no spill at head_dim 128).
GRAM_ROWS = 32
# The scan: 16 segments x 512 state entries per load (1M tokens, 8 kv heads, segment 2048, one
# H200: 122 us per memory scan against 228 with 16 x 256 and 142-390 with 64-256 entries).
SCAN_SEGMENTS, SCAN_BLOCK = 16, 512


# (rows per block, warps, pipeline stages) per kernel at head_dim 128, from a sweep of 17
# configurations on an H200 at 1M tokens, segment 2048, 8 heads, bf16 (launch/tune_infini.py,
# docs/experiments.md §26): 1.2-1.7x faster than 8 warps and 3 stages everywhere but the Gram
# gradient pass ("gram_backward"), which keeps them. The retrieval's backward, which sums the
# memory's gradient in the same pass since, was swept again on an H100 (§30): 64 rows, 8 warps
# and 2 stages 7.9 ms, 4 warps 13-23 ms. Kernels not named here keep the defaults.
TUNED_HEAD_DIM_128 = {
    "updates": (64, 4, 3),
    "gram": (32, 8, 1),
    "updates_backward": (64, 4, 2),
    "gram_den": (32, 4, 3),
    "retrieval": (64, 8, 1),
    "retrieval_backward": (64, 8, 2),
}


def tiles(head_dim: int, dtype: torch.dtype, block_n: int, block_m: int, kernel: str | None = None) -> dict:
    """The memory kernels' constexprs and launch options for head_dim and the inputs' dtype;
    ``kernel`` names a row of TUNED_HEAD_DIM_128, which replaces block_m and the options at
    head_dim 128. Above head_dim 128 the row loops are not software-pipelined: as a launch
    builds them (16-divisible pointers and strides), 3 stages of the head_dim-256 tiles need
    0.3-0.6 MB of shared memory per program (the H100/H200 have 227 KB), 1 stage 49-135 KB."""
    bd = block_d(head_dim)
    num_warps, num_stages = 8 if bd >= 128 else 4, 3 if bd <= 128 else 1
    if bd == 128 and kernel in TUNED_HEAD_DIM_128:
        block_m, num_warps, num_stages = TUNED_HEAD_DIM_128[kernel]
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=min(block_n, bd), BLOCK_M=block_m,
        LOW_PRECISION=dtype == torch.bfloat16, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def column_tile(head_dim: int) -> int:
    """Columns per block of the row-streaming kernels: all of them up to 128."""
    return 128 if head_dim <= 128 else 64


def row_tile(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def row_chunk(segment_rows: int, other_programs: int, block_m: int) -> tuple[int, int]:
    """(rows per program, chunks per segment): whole segments while the (segment, head)
    programs number CHUNK_PROGRAMS or more, else shorter chunks, whole row blocks each."""
    blocks = triton.cdiv(segment_rows, block_m)
    chunks = max(1, min(blocks, triton.cdiv(CHUNK_PROGRAMS, other_programs)))
    rows = triton.cdiv(blocks, chunks) * block_m
    return rows, triton.cdiv(segment_rows, rows)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a memory that only feeds products: bf16 for bf16 inputs (the products'
    operands are bf16 there anyway), float32 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _n_seg(seqlen: int, segment_len: int) -> int:
    return -(-seqlen // segment_len)


def _launch_updates(
    k: torch.Tensor, v: torch.Tensor, segment_len: int, updates: bool, z_before: torch.Tensor | None,
    even_updates: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dM, dz) with ``updates`` (``even_updates``: the even segments' only), A_s with
    ``z_before``; None for those not asked for."""
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    b, s, kv_heads, d = k.shape
    n_seg = _n_seg(s, segment_len)
    dm = dz = gram = None
    hopper = uses_infini_updates(k, v)
    if updates:
        n_out = -(-n_seg // 2) if even_updates and hopper else n_seg
        dm = torch.empty(b, n_out, kv_heads, d, d, device=k.device, dtype=torch.float32)
        dz = torch.empty(b, n_out, kv_heads, d, device=k.device, dtype=torch.float32)
    if z_before is not None:
        z_before = z_before.float().contiguous()
        # A_s only feeds the recurrence's products: in their operand dtype
        gram = torch.empty(b, n_seg, kv_heads, d, d, device=k.device, dtype=operand_dtype(k.dtype))
    if hopper:  # one pass for both (for the odd segments' A_s, one over k alone)
        launch = hopper_module("infini_updates").launch_updates
        launch(k, v, segment_len, dm, dz, z_before, gram, even_updates)
        return dm, dz, gram
    wide = b * n_seg * kv_heads >= WIDE_STATE_PROGRAMS and d <= 128
    for out, is_gram in ((dm, False), (gram, True)):  # two passes: Triton's kernel makes one or the other
        if out is None:
            continue
        t = tiles(d, k.dtype, 128 if wide else 64, row_tile(d), "gram" if is_gram else "updates")
        grid = (b * n_seg, kv_heads, triton.cdiv(d, t["BLOCK_N"]))
        values = k if is_gram else v
        z_in, dz_out = (z_before, out) if is_gram else (out, dz)  # the Gram reads z, writes no dz
        _update_kernel[grid](
            k, values, z_in, out, dz_out, s, n_seg, segment_len, kv_heads, *k.stride()[:3],
            *values.stride()[:3], GRAM=is_gram, **t,
        )  # fmt: skip
    if even_updates and dm is not None:  # Triton's kernel makes every segment's
        dm, dz = dm[:, ::2].contiguous(), dz[:, ::2].contiguous()
    return dm, dz, gram


def memory_updates(
    k: torch.Tensor, v: torch.Tensor, segment_len: int, even_updates: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """What each segment adds to the memory: k, v (batch, seqlen, kv_heads, head_dim) ->
    (sigma(K_s)^T V_s (batch, segments, kv_heads, head_dim, head_dim), sum of sigma(K_s)
    (batch, segments, kv_heads, head_dim)), float32. On an H100/H200 with bf16 inputs of head_dim
    128, the Hopper kernel (``hopper/infini_updates.py``, ``dispatch.uses_infini_updates``).
    ``even_updates``: segments 0, 2, 4, ... only (ceil(segments / 2) of them; the Hopper kernel
    reads no other segment's tokens)."""
    return _launch_updates(k, v, segment_len, True, None, even_updates)[:2]


def normalizer_updates(k: torch.Tensor, segment_len: int) -> torch.Tensor:
    """``memory_updates``' second output alone, from one read of k: k (batch, seqlen, kv_heads,
    head_dim) -> the sum of sigma(K_s) per segment (batch, segments, kv_heads, head_dim), float32
    (summed in float32, where the Hopper updates kernel sums sigma(K) as its bf16 operand)."""
    k = last_dim_contiguous(k)
    b, s, kv_heads, d = k.shape
    n_seg = _n_seg(s, segment_len)
    dz = torch.empty(b, n_seg, kv_heads, d, device=k.device, dtype=torch.float32)
    bd = block_d(d)
    _normalizer_update_kernel[(b * n_seg, kv_heads)](
        k, dz, s, n_seg, segment_len, kv_heads, *k.stride()[:3],
        HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=NORMALIZER_ROWS * 128 // bd, num_warps=8,
    )  # fmt: skip
    return dz


# Token rows per step of the normalizer pass at head_dim 128, on 8 warps (proportionally fewer
# at larger head dims): at 1M tokens, 8 heads, segment 2048 on an H200, 0.58 ms against 0.67
# for 64 rows on 4 or 8 warps and 0.76-0.78 for 128.
NORMALIZER_ROWS = 32


def memory_gram(k: torch.Tensor, z_before: torch.Tensor, segment_len: int) -> torch.Tensor:
    """The delta rule's per-segment A_s = sigma(K_s)^T diag(w) sigma(K_s), w = 1 / (sigma(K_s)
    z_s) per token (0 where that is 0): k (batch, seqlen, kv_heads, head_dim), z_before (batch,
    segments, kv_heads, head_dim) float32 -> (batch, segments, kv_heads, head_dim, head_dim) in
    ``operand_dtype`` (bf16 for bf16 k: it only feeds the recurrence's products)."""
    return _launch_updates(k, k, segment_len, False, z_before)[2]


def memory_updates_and_gram(
    k: torch.Tensor, v: torch.Tensor, z_before: torch.Tensor, segment_len: int, even_updates: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``memory_updates``' two outputs (``even_updates``: the even segments' only) and
    ``memory_gram``'s (every segment's), from one read of k and v on the Hopper kernel (the delta
    rule's backward rebuilds its memories with both; from every other kept memory it takes the
    even segments' updates alone, and the odd segments' v is not read)."""
    return _launch_updates(k, v, segment_len, True, z_before, even_updates)


def _launch_updates_backward(k, v, segment_len, grad_dm, grad_dz, gram_grad, den_only):
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    b, s, kv_heads, d = k.shape
    n_seg = _n_seg(s, segment_len)
    matrix_dtype = operand_dtype(k.dtype)
    if gram_grad is None:
        t = tiles(d, k.dtype, column_tile(d), row_tile(d), "updates_backward")
    else:
        t = tiles(d, k.dtype, column_tile(d), GRAM_ROWS, "gram_den" if den_only else "gram_backward")
    chunk, chunks = row_chunk(min(segment_len, s), b * n_seg * kv_heads, t["BLOCK_M"])
    s_grad = z_before = gz_part = k  # unused pointers
    if gram_grad is not None:
        s_grad = gram_grad[0].to(matrix_dtype).contiguous()
        z_before = gram_grad[1].float().contiguous()
    if den_only:
        if uses_infini_updates(k, k):
            chunk = row_chunk(min(segment_len, s), b * n_seg * kv_heads, 64)[0]
            return hopper_module("infini_gram_den").launch_gram_den(k, s_grad, z_before, segment_len, chunk)
        dk = dv = grad_dm = grad_dz = k
        gz_part = torch.empty(chunks, b, n_seg, kv_heads, d, device=k.device, dtype=torch.float32)
    else:
        grad_dm = grad_dm.to(matrix_dtype).contiguous()
        grad_dz = grad_dz.float().contiguous()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        if gram_grad is None and uses_infini_updates(k, v):
            chunk = row_chunk(min(segment_len, s), b * n_seg * kv_heads, 64)[0]
            launch = hopper_module("infini_updates").launch_updates_backward
            launch(k, v, grad_dm, grad_dz, dk, dv, segment_len, chunk)
            return dk, dv
    _update_backward_kernel[(chunks, b * n_seg, kv_heads)](
        k, v, grad_dm, grad_dz, dk, dv, s_grad, z_before, gz_part, s, n_seg, segment_len, chunk, kv_heads,
        *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        GRAM=gram_grad is not None, DEN_ONLY=den_only, **t,
    )  # fmt: skip
    return gz_part.sum(0) if den_only else (dk, dv)


def memory_updates_backward(
    k: torch.Tensor,
    v: torch.Tensor,
    segment_len: int,
    grad_dm: torch.Tensor,
    grad_dz: torch.Tensor,
    gram_grad: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (dk, dv) of ``memory_updates`` given those of its two outputs (grad_dm is
    read as ``operand_dtype``: pass it in that dtype to skip a conversion). ``gram_grad`` (S,
    z_before) adds the gradient of ``memory_gram`` through sigma(K) given S = dA + dA^T (batch,
    segments, kv_heads, head_dim, head_dim); its gradient through z_before is
    ``memory_gram_den_backward``'s, which grad_dz must already include. Without ``gram_grad``,
    the Hopper kernel runs where ``memory_updates``' does."""
    return _launch_updates_backward(k, v, segment_len, grad_dm, grad_dz, gram_grad, den_only=False)


def memory_gram_den_backward(
    k: torch.Tensor, segment_len: int, s_grad: torch.Tensor, z_before: torch.Tensor
) -> torch.Tensor:
    """The gradient of z_before (batch, segments, kv_heads, head_dim), float32, through
    ``memory_gram``'s weights w, given S = dA + dA^T. The Hopper kernel
    (``hopper/infini_gram_den.py``) runs where ``memory_updates``' does."""
    return _launch_updates_backward(k, k, segment_len, None, None, (s_grad, z_before), den_only=True)


def memory_scan(
    updates: torch.Tensor, initial: torch.Tensor | None, dtype: torch.dtype, reverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exclusive sums over segments: updates (batch, segments, kv_heads, *state) float32 and
    initial (batch, kv_heads, *state) (None: zeros) -> (initial + the sum over the segments
    before each one (after it with ``reverse``), in ``dtype``, updates' shape; initial + the sum
    over all segments, float32, initial's shape). The backward of the forward sum is the same
    scan reversed, starting from the gradient of the total."""
    b, n_seg, kv_heads = updates.shape[:3]
    state = updates.shape[3:]
    width = updates[0, 0, 0].numel()
    updates = updates.float().contiguous()
    before = torch.empty(updates.shape, device=updates.device, dtype=dtype)
    total = torch.empty(b, kv_heads, *state, device=updates.device, dtype=torch.float32)
    init = total if initial is None else initial.float().contiguous()
    grid = (b * kv_heads, triton.cdiv(width, SCAN_BLOCK))
    _scan_kernel[grid](
        updates, init, before, total, n_seg, kv_heads, width, HAS_INIT=initial is not None,
        REVERSE=reverse, SEGMENTS=SCAN_SEGMENTS, BLOCK=SCAN_BLOCK,
    )  # fmt: skip
    return before, total
