"""Infini-attention's delta-rule memory: the recurrence over segments and its backward.

For segment s of a batch row and key/value head, with sigma = ELU + 1, K~ = sigma(K_s), the
memory (M_s, z_s) before the segment and w = 1 / (K~ z_s) per token (0 where K~ z_s = 0: an
empty memory retrieves nothing):

    M_{s+1} = M_s + K~^T (V_s - diag(w) K~ M_s) = M_s + B_s - A_s M_s,
    B_s = K~^T V_s (the linear rule's update),  A_s = K~^T diag(w) K~ (a weighted Gram matrix)

z_s is a plain sum over segments, so B_s and A_s are computed for all segments at once by the
token kernels of ``memory.py`` (``memory_updates``, ``memory_gram``), and only the head_dim x
head_dim recurrence runs in order over the segments (``_delta_scan_kernel``): one program per
(batch row, kv head, column block of M), since column block c of M_{s+1} reads only column
block c of M_s and B_s.

Backward, with X_s = dL/dM_{s+1} (X_last = the final memory's gradient) and G_s the retrieval's
gradient of M_s:

    dL/dM_s = G_s + X_s - A_s^T X_s         (``delta_scan`` reversed, A transposed)
    dB_s = X_s,   dA_s = -X_s M_s^T         (the keys' gradient reads S = dA + dA^T, which
                                             ``gram_gradient`` writes in one pass)

and the tokens' gradients through B_s and A_s (``memory_updates_backward`` with its
``gram_grad``, or the local attention's backward where it runs that pass) and through z_s,
on which w depends (``delta_gram_grads``: ``memory_gram_den_backward``, then the reverse scan
over the segments). The caller keeps the M_s, or those before every other segment (the
backward then steps once from each: ``expand_kept_memories``), or rebuilds them (from k, v and
the memory entering), and rebuilds A_s from k.

Precision: B_s and A_s take the token kernels' operands (bf16 for bf16 inputs, float32
otherwise). For bf16 inputs A_s is stored in bf16 and the recurrence's products take bf16
operands (the state rounded for the product only: A_s x is a correction to x); otherwise A_s is
float32 and the products exact ("ieee") for float32 inputs, TF32 for float16. The M_s and X_s
the recurrences store for their readers are in the operand dtype too (bf16 for bf16 inputs, as
the retrieval and the local attention's backward take them); S's products read them as stored
and multiply in float32 (TF32 but for float32 inputs); sums and states are float32.

Tensors: k, v (batch, seqlen, kv_heads, head_dim) with a contiguous last dim; per-segment states
(batch, segments, kv_heads, head_dim[, head_dim]) and memories (batch, kv_heads, head_dim[,
head_dim]), float32, contiguous. Segment s covers tokens [s * segment_len, min((s + 1) *
segment_len, seqlen)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import block_d
from ..hopper.dispatch import uses_infini_updates
from .memory import (
    memory_gram,
    memory_gram_den_backward,
    memory_scan,
    memory_updates,
    memory_updates_and_gram,
    normalizer_updates,
    operand_dtype,
)


@triton.jit
def _load_tile(base, rows_i, rows_j, TRANSPOSE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The (rows_i, rows_j) tile of the head_dim x head_dim matrix at ``base``, or of its
    transpose (read row by row as stored and transposed in registers)."""
    if TRANSPOSE:
        r, c = rows_j, rows_i
    else:
        r, c = rows_i, rows_j
    mask = (r[:, None] < HEAD_DIM) & (c[None, :] < HEAD_DIM)
    tile = tl.load(base + r[:, None] * HEAD_DIM + c[None, :], mask=mask, other=0.0)
    if TRANSPOSE:
        tile = tl.trans(tile)
    return tile


@triton.jit
def _delta_scan_kernel(
    U, A, INIT, OUT, FINAL, n_seg, kv_heads,
    HAS_INIT: tl.constexpr, TRANSPOSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
    BF16_PRODUCTS: tl.constexpr,
):  # fmt: skip
    """One (batch row, kv head, column block), segments in order (reversed with TRANSPOSE):
    OUT[s] = x, then x += U[s] - A[s] x (A[s]^T x with TRANSPOSE); FINAL = x at the end. x starts
    at INIT (zeros without), float32. BF16_PRODUCTS: A is bf16 and x is rounded to bf16 for the
    product. With BLOCK_R == BLOCK_D x stays in registers and the loads of A and U, which do not
    depend on x, are pipelined ahead of the chain; with TRANSPOSE the program holds x^T and
    computes x^T A, so that A is read as stored (a transposed read of A was 5x slower). With
    smaller row tiles (head_dim 256) x's rows pass through OUT in global memory (a step reads the
    x it has just stored, after a barrier)."""
    pid = tl.program_id(0).to(tl.int64)
    b, h = pid // kv_heads, pid % kv_heads
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HEAD_DIM
    width = HEAD_DIM * HEAD_DIM
    if BLOCK_R == BLOCK_D:
        rows = tl.arange(0, BLOCK_D)
        row_ok = rows < HEAD_DIM
        a_offs, a_mask = rows[:, None] * HEAD_DIM + rows[None, :], row_ok[:, None] & row_ok[None, :]
        if TRANSPOSE:  # x^T: element (c, r) is x[r, c]
            offs, mask = cols[:, None] + rows[None, :] * HEAD_DIM, col_ok[:, None] & row_ok[None, :]
        else:
            offs, mask = rows[:, None] * HEAD_DIM + cols[None, :], row_ok[:, None] & col_ok[None, :]
        if HAS_INIT:
            x = tl.load(INIT + pid * width + offs, mask=mask, other=0.0)
        elif TRANSPOSE:
            x = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        else:
            x = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
        for step in tl.range(0, n_seg, num_stages=STAGES):
            s = n_seg - 1 - step if TRANSPOSE else step
            state = (b * n_seg + s) * kv_heads + h
            a = tl.load(A + state * width + a_offs, mask=a_mask, other=0.0)
            u = tl.load(U + state * width + offs, mask=mask, other=0.0)
            operand = x.to(tl.bfloat16) if BF16_PRODUCTS else x
            stored = operand if OUT.dtype.element_ty == operand.dtype else x.to(OUT.dtype.element_ty)
            tl.store(OUT + state * width + offs, stored, mask=mask)
            if TRANSPOSE:
                x = x + u - tl.dot(operand, a, input_precision=DOT_PRECISION)
            else:
                x = x + u - tl.dot(a, operand, input_precision=DOT_PRECISION)
        tl.store(FINAL + pid * width + offs, x, mask=mask)
    else:
        first = n_seg - 1 if TRANSPOSE else 0
        first_base = OUT + ((b * n_seg + first) * kv_heads + h) * width
        for r0 in tl.static_range(0, BLOCK_D, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            offs = rows[:, None] * HEAD_DIM + cols[None, :]
            mask = (rows[:, None] < HEAD_DIM) & col_ok[None, :]
            if HAS_INIT:
                x = tl.load(INIT + pid * width + offs, mask=mask, other=0.0)
            else:
                x = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
            tl.store(first_base + offs, x, mask=mask)
        for step in range(0, n_seg):
            s = n_seg - 1 - step if TRANSPOSE else step
            state = (b * n_seg + s) * kv_heads + h
            x_base = OUT + state * width
            if step + 1 < n_seg:
                nxt = n_seg - 2 - step if TRANSPOSE else step + 1
                dst = OUT + ((b * n_seg + nxt) * kv_heads + h) * width
            else:
                dst = FINAL + pid * width
            tl.debug_barrier()  # x (this step's OUT) as stored by every thread of the program
            for i0 in tl.static_range(0, BLOCK_D, BLOCK_R):
                rows_i = i0 + tl.arange(0, BLOCK_R)
                offs_i = rows_i[:, None] * HEAD_DIM + cols[None, :]
                mask_i = (rows_i[:, None] < HEAD_DIM) & col_ok[None, :]
                acc = tl.load(x_base + offs_i, mask=mask_i, other=0.0)
                acc += tl.load(U + state * width + offs_i, mask=mask_i, other=0.0)
                for j0 in tl.static_range(0, BLOCK_D, BLOCK_R):
                    rows_j = j0 + tl.arange(0, BLOCK_R)
                    j_ok = rows_j < HEAD_DIM
                    a = _load_tile(A + state * width, rows_i, rows_j, TRANSPOSE, HEAD_DIM)
                    x_j = tl.load(x_base + rows_j[:, None] * HEAD_DIM + cols[None, :],
                                  mask=j_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
                    if BF16_PRODUCTS:
                        x_j = x_j.to(tl.bfloat16)
                    acc -= tl.dot(a, x_j, input_precision=DOT_PRECISION)
                tl.store(dst + offs_i, acc, mask=mask_i)


# Columns of M per scan program: the scan is a chain of n_seg dependent steps per program, each a
# (head_dim x head_dim) @ (head_dim x columns) product whose A tile (64 KB in float32, 32 KB in
# bf16 at head_dim 128) comes from L2, so the step's time is that load's; narrow blocks give more
# programs on as many SMs. x stays in registers up to DELTA_REGISTER_ROWS rows (the A tile's loads
# pipelined ahead), else it goes through global memory in tiles of DELTA_ROWS rows. float32 A: 16
# columns, 3 stages, 8 warps, 0.61 / 0.85 ms (forward / transposed) at 512 segments x 8 heads of
# 128 on an H200, against 1.07 for 32 columns and 2 stages (32 x 3 overflow shared memory); bf16 A:
# 8 columns, 4 stages, 4 warps, 0.33 / 0.42 ms (16 columns: 0.37 / 0.49).
DELTA_COLUMNS = 16
DELTA_COLUMNS_BF16 = 8
DELTA_REGISTER_ROWS = 128
DELTA_ROWS = 64
DELTA_STAGES = 3
DELTA_STAGES_BF16 = 4


def scan_tiles(head_dim: int, dtype: torch.dtype) -> dict:
    """The recurrence kernel's constexprs and launch options for head_dim and the inputs' dtype
    (bf16: A in bf16, bf16 products)."""
    bd = block_d(head_dim)
    rows = bd if bd <= DELTA_REGISTER_ROWS else min(DELTA_ROWS, bd)
    bf16 = dtype == torch.bfloat16
    columns, stages = (DELTA_COLUMNS_BF16, DELTA_STAGES_BF16) if bf16 else (DELTA_COLUMNS, DELTA_STAGES)
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_R=rows, BLOCK_N=min(columns, bd), STAGES=stages,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", BF16_PRODUCTS=bf16,
        num_warps=8 if rows >= 128 and not bf16 else 4,
    )  # fmt: skip


def delta_scan(
    updates: torch.Tensor, gram: torch.Tensor, initial: torch.Tensor | None, dtype: torch.dtype,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x_0 = initial, OUT[s] = x_s, x_{s+1} = x_s + updates[s] - gram[s] x_s over the segments
    (reversed, with gram[s]^T, when ``transpose``): updates and gram (batch, segments, kv_heads,
    head_dim, head_dim), initial (batch, kv_heads, head_dim, head_dim) or None (zeros) ->
    (OUT, the x after the last step in float32). ``dtype`` (the inputs') sets the products'
    precision and the dtype of gram and OUT (``operand_dtype``: bf16 for bf16 inputs, else
    float32; OUT's readers take it as a product's operand). The state is float32 whatever OUT's
    dtype (a bf16 OUT is rounded as stored)."""
    b, n_seg, kv_heads, d = updates.shape[:4]
    updates, gram = updates.float().contiguous(), gram.to(operand_dtype(dtype)).contiguous()
    t = scan_tiles(d, dtype)
    # Row tiles smaller than the state pass it through OUT, which must then hold float32.
    through_out = t["BLOCK_R"] < t["BLOCK_D"]
    out_dtype = operand_dtype(dtype)
    out = torch.empty(updates.shape, device=updates.device, dtype=torch.float32 if through_out else out_dtype)
    final = torch.empty(b, kv_heads, d, d, device=updates.device, dtype=torch.float32)
    init = final if initial is None else initial.float().contiguous()
    _delta_scan_kernel[(b * kv_heads, triton.cdiv(d, t["BLOCK_N"]))](
        updates, gram, init, out, final, n_seg, kv_heads,
        HAS_INIT=initial is not None, TRANSPOSE=transpose, **t,
    )  # fmt: skip
    return out.to(out_dtype), final


@triton.jit
def _kept_step_kernel(
    KEPT, U, A, OUT, n_seg, n_kept, kv_heads,
    GRAM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BF16_PRODUCTS: tl.constexpr,
):  # fmt: skip
    """One (batch row, kept memory p, kv head; row block, column block): OUT[2p] = KEPT[p] and,
    where segment 2p + 1 exists, OUT[2p + 1] = KEPT[p] + U[p] (- A[2p] KEPT[p] with GRAM; U the
    even segments' updates), as a step of ``_delta_scan_kernel`` from the state it stored."""
    pid = tl.program_id(0).to(tl.int64)  # (b * n_kept + p) * kv_heads + h
    h, bp = pid % kv_heads, pid // kv_heads
    even = ((bp // n_kept) * n_seg + 2 * (bp % n_kept)) * kv_heads + h
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    width = HEAD_DIM * HEAD_DIM
    offs = rows[:, None] * HEAD_DIM + cols[None, :]
    mask = (rows[:, None] < HEAD_DIM) & (cols[None, :] < HEAD_DIM)
    x = tl.load(KEPT + pid * width + offs, mask=mask, other=0.0)
    tl.store(OUT + even * width + offs, x, mask=mask)
    if 2 * (bp % n_kept) + 1 < n_seg:
        step = x.to(tl.float32) + tl.load(U + pid * width + offs, mask=mask, other=0.0)
        if GRAM:
            acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
            for k0 in tl.static_range(0, HEAD_DIM, BLOCK):
                ks = k0 + tl.arange(0, BLOCK)
                a = _load_tile(A + even * width, rows, ks, False, HEAD_DIM)
                m = _load_tile(KEPT + pid * width, ks, cols, False, HEAD_DIM)
                if BF16_PRODUCTS:
                    m = m.to(tl.bfloat16)
                acc = tl.dot(a, m, acc, input_precision=DOT_PRECISION)
            step = step - acc
        tl.store(OUT + (even + kv_heads) * width + offs, step.to(OUT.dtype.element_ty), mask=mask)


def expand_kept_memories(
    kept: torch.Tensor, even_updates: torch.Tensor, gram: torch.Tensor | None, n_seg: int, dtype: torch.dtype
) -> torch.Tensor:  # fmt: skip
    """The memories before every segment from those the forward kept before the even ones (the
    backward's rebuild without a recurrence): kept (batch, ceil(n_seg / 2), kv_heads, head_dim,
    head_dim) in ``operand_dtype(dtype)``, even_updates (kept's shape, float32: B_s, or the
    linear rule's dM_s, of segments 0, 2, 4, ...), gram A_s of every segment as ``delta_scan``
    takes it, or None for the linear rule -> (batch, n_seg, kv_heads, head_dim, head_dim) in
    ``operand_dtype(dtype)``: M_2p = kept[p], M_2p+1 = kept[p] + even_updates[p] (- gram[2p]
    kept[p]). The step starts from the kept M as stored (bf16 for bf16 inputs), where the
    forward's recurrence held it in float32: M_2p+1 can differ from the forward's by its rounding."""
    b, n_kept, kv_heads, d = kept.shape[:4]
    if n_kept != -(-n_seg // 2) or even_updates.shape != kept.shape:
        raise ValueError(
            f"kept {tuple(kept.shape)}: expected the memories before the even ones of {n_seg} segments, "
            f"ceil({n_seg} / 2) of them, and even_updates of that shape (got {tuple(even_updates.shape)})"
        )
    if gram is not None and gram.shape[:2] != (b, n_seg):
        raise ValueError(f"gram {tuple(gram.shape)}: expected A_s of all {n_seg} segments of {b} batch rows")
    out = torch.empty(b, n_seg, *kept.shape[2:], device=kept.device, dtype=operand_dtype(dtype))
    updates = even_updates.float().contiguous()
    with_gram = gram is not None
    gram = gram.to(operand_dtype(dtype)).contiguous() if with_gram else updates  # not read without
    t = scan_tiles(d, dtype)
    block = min(KEPT_STEP_TILE, t["BLOCK_D"])
    n = triton.cdiv(d, block)
    _kept_step_kernel[(b * n_kept * kv_heads, n, n)](
        kept.to(operand_dtype(dtype)).contiguous(), updates, gram, out, n_seg, n_kept, kv_heads,
        GRAM=with_gram, HEAD_DIM=d, BLOCK=block, DOT_PRECISION=t["DOT_PRECISION"],
        BF16_PRODUCTS=t["BF16_PRODUCTS"],
    )  # fmt: skip
    return out


# Rows and columns of M per program of the kept step (64 x 64 float32 outputs, the product's
# operands 64-wide chunks of A and the kept M).
KEPT_STEP_TILE = 64


def delta_memories(
    k: torch.Tensor, v: torch.Tensor, m_in: torch.Tensor, z_in: torch.Tensor, segment_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta rule over all segments: k, v (batch, seqlen, kv_heads, head_dim), the memory
    entering the sequence m_in (batch, kv_heads, head_dim, head_dim) and z_in (batch, kv_heads,
    head_dim) -> (M before each segment (batch, segments, kv_heads, head_dim, head_dim) in
    ``operand_dtype`` (what the retrieval and the backward read), M after the last one, z before
    each segment (batch, segments, kv_heads, head_dim), z after the last one; float32)."""
    dm, dz = delta_normalizer_updates(k, v, segment_len)
    z_before, z_final = memory_scan(dz, z_in, torch.float32)
    dm, gram = delta_updates(k, v, z_before, segment_len, dm)
    m_before, m_final = delta_scan(dm, gram, m_in, k.dtype)
    return m_before, m_final, z_before, z_final


def delta_normalizer_updates(
    k: torch.Tensor, v: torch.Tensor, segment_len: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(B_s or None, dz_s): what the delta rule needs before z before each segment is known.
    Where one pass over k and v makes B_s and A_s (the Hopper updates kernel), dz_s alone
    (``normalizer_updates``, a pass over k) and B_s later with A_s (``delta_updates``); else
    B_s and dz_s in one pass (``memory_updates``) and A_s alone later."""
    if uses_infini_updates(k, v):
        return None, normalizer_updates(k, segment_len)
    return memory_updates(k, v, segment_len)


def delta_updates(
    k: torch.Tensor, v: torch.Tensor, z_before: torch.Tensor, segment_len: int, dm: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B_s, A_s) given z before each segment and ``delta_normalizer_updates``' B_s (None:
    computed here, beside A_s)."""
    if dm is None:
        dm, _, gram = memory_updates_and_gram(k, v, z_before, segment_len)
        return dm, gram
    return dm, memory_gram(k, z_before, segment_len)


@triton.jit
def _gram_gradient_kernel(
    X, MEMORY, OUT, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The (row block, column block) tile of one state's -(X M^T + M X^T): row blocks of X and M
    against row blocks of M and X, read as stored, over the head_dim in chunks of BLOCK_K."""
    base = tl.program_id(0).to(tl.int64) * HEAD_DIM * HEAD_DIM
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in tl.static_range(0, BLOCK_D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks[None, :] < HEAD_DIM
        row_offs, row_mask = rows[:, None] * HEAD_DIM + ks[None, :], (rows[:, None] < HEAD_DIM) & k_ok
        col_offs, col_mask = cols[:, None] * HEAD_DIM + ks[None, :], (cols[:, None] < HEAD_DIM) & k_ok
        x_rows = tl.load(X + base + row_offs, mask=row_mask, other=0.0).to(tl.float32)
        m_cols = tl.load(MEMORY + base + col_offs, mask=col_mask, other=0.0).to(tl.float32)
        acc = tl.dot(x_rows, tl.trans(m_cols), acc, input_precision=DOT_PRECISION)
        m_rows = tl.load(MEMORY + base + row_offs, mask=row_mask, other=0.0).to(tl.float32)
        x_cols = tl.load(X + base + col_offs, mask=col_mask, other=0.0).to(tl.float32)
        acc = tl.dot(m_rows, tl.trans(x_cols), acc, input_precision=DOT_PRECISION)
    out_mask = (rows[:, None] < HEAD_DIM) & (cols[None, :] < HEAD_DIM)
    out = (-acc).to(OUT.dtype.element_ty)
    tl.store(OUT + base + rows[:, None] * HEAD_DIM + cols[None, :], out, mask=out_mask)


# Tiles of the Gram gradient: 128 x 128 outputs (one program per state at head_dim 128) on 8
# warps, the head_dim in chunks of 32: four float32 operand tiles of 16 KB, at any head_dim. At
# 512 segments x 8 heads of 128 with bf16 X and M on an H200: 217 us, against 348 for 64 x 64
# outputs in chunks of 64 on 4 warps (64 x 128 chunks: 296; 128 x 64 chunks: 275).
GRAM_GRADIENT_TILE, GRAM_GRADIENT_K = 128, 32


def gram_gradient_tiles(head_dim: int, dtype: torch.dtype) -> dict:
    """The Gram gradient kernel's constexprs and launch options for head_dim and the inputs' dtype."""
    bd = block_d(head_dim)
    tile = min(GRAM_GRADIENT_TILE, bd)
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK=tile, BLOCK_K=min(GRAM_GRADIENT_K, bd),
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=8 if tile >= 128 else 4,
    )  # fmt: skip


def gram_gradient(x: torch.Tensor, m_before: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """S = dA + dA^T = -(X M^T + M X^T) per state (dA_s = -X_s M_s^T: the gradient of A_s through
    the recurrence) in one pass: x (the reversed scan's output) and m_before (..., head_dim,
    head_dim), float32 or the operand dtype -> x's shape in ``operand_dtype``
    (bf16 for bf16 inputs: every reader of S takes it as a bf16 operand). ``dtype`` (the
    inputs') sets the products' precision, as the recurrence's."""
    x, m_before = x.contiguous(), m_before.contiguous()
    d = x.shape[-1]
    out = torch.empty(x.shape, device=x.device, dtype=operand_dtype(dtype))
    t = gram_gradient_tiles(d, dtype)
    n = triton.cdiv(d, t["BLOCK"])
    _gram_gradient_kernel[(x.numel() // (d * d), n, n)](x, m_before, out, **t)
    return out


def delta_gram_grads(
    k: torch.Tensor, z_before: torch.Tensor, segment_len: int, s_grad: torch.Tensor,
    grad_z_before: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The gradient of z before each segment (batch, segments, kv_heads, head_dim), float32:
    ``grad_z_before`` (the retrieval's; None: zero) plus that through A_s's weights w given S =
    dA + dA^T (``gram_gradient``). The reverse scan over the segments (``memory_scan``)
    turns it into the gradient of each segment's z update, which the dk/dv pass takes with S (in
    the local attention's backward, ``local.local_backward``, or ``memory_updates_backward``)."""
    grad_z = memory_gram_den_backward(k, segment_len, s_grad, z_before)
    if grad_z_before is not None:
        grad_z += grad_z_before
    return grad_z
