"""The delta rule's gradient of z through its Gram weights (``infini/memory.py``'s
``memory_gram_den_backward``) for Hopper (sm_90) in Gluon: bf16, head_dim 128. For segment s of
a batch row and kv head, with S = dA_s + dA_s^T (``infini/delta.py``), sigma(K) the segment's
keys' features and w = 1 / (sigma(K) z_s) per token:

    P = sigma(K) S,   dden = -w^2 rowsum(P * sigma(K)) / 2,   gz_s = sum over the tokens of dden sigma(K)

The Triton pass reads k at under a third of an H200's bandwidth (2.3 ms at 1M tokens, 8 heads,
segment 2048; docs/experiments.md §46). Here the item stream of the updates' backward
(``infini_updates.stream_loader``: k alone, S once per item in bf16, as the Triton pass reads it)
feeds two compute warpgroups that take alternate 64-token blocks: sigma(K) goes over the block's
k tile as P's operand (M = 64 tokens, K = 128), and the row sums and the weighted sum over the
tokens take sigma(K) in float32 from registers, as the Triton pass's. Each warpgroup sums its
tokens' dden sigma(K) in a (64, 128) register tile and writes one row per item; the caller adds
the rows (no atomics: the same bits every run).

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

from .infini_updates import (
    BLOCK_T,
    COMPUTE_REGS,
    HEAD_DIM,
    LOADER_REGS,
    MAX_REGISTERS,
    STAGES,
    allocate_stream,
    await_item_matrix,
    block_layout,
    inverse,
    matrix_descriptor,
    sigma,
    stream_loader,
    token_descriptor,
)


@gluon.jit
def _den_compute(
    k_smem, s_smem, ready, empty, s_ready, s_empty, Z, PARTS, seqlen, n_seg, segment_len, kv_heads, chunk,
    n_chunks, n_items, w: gl.constexpr,
):  # fmt: skip
    """Compute warpgroup w: the blocks j of the program with j % 2 == w; per item its part of
    gz_s into row item * 2 + w of PARTS (zeros where it had no block)."""
    dtype: gl.constexpr = k_smem.dtype
    acc_l: gl.constexpr = block_layout(HEAD_DIM)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_l))
    tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, acc_l))
    i = 0
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        args = (seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks)
        state, b, h, lo, hi, s_mat = await_item_matrix(item, i, s_smem, s_ready, *args)
        z = gl.load(Z + state.to(gl.int64) * HEAD_DIM + cols)
        part = gl.zeros([BLOCK_T, HEAD_DIM], gl.float32, acc_l)
        for t in range(lo, hi, BLOCK_T):
            if j % 2 == w:
                st = j % STAGES
                mbarrier.wait(ready.index(st), (j // STAGES) & 1)
                k_tile = k_smem.index(st)
                # Tokens past the chunk (the next one's, or TMA's zero fill past the tensor) add
                # nothing: sigma(0) is 1.
                sig = gl.where(((t + tokens) < hi)[:, None], sigma(k_tile.load(acc_l).to(gl.float32)), 0.0)
                weights = inverse(gl.sum(sig * z[None, :], 1))
                k_tile.store(sig.to(dtype))  # each thread rewrites what it read
                fence_async_shared()
                p = gl.zeros([BLOCK_T, HEAD_DIM], gl.float32, acc_l)
                p = warpgroup_mma(k_tile, s_mat, p, use_acc=False, is_async=True)
                p = warpgroup_mma_wait(0, deps=(p,))
                mbarrier.arrive(empty.index(st), count=1)
                dden = -0.5 * weights * weights * gl.sum(p * sig, 1)
                part += sig * dden[:, None]
            j += 1
        mbarrier.arrive(s_empty.index(i % 2), count=1)
        gl.store(PARTS + (item.to(gl.int64) * 2 + w) * HEAD_DIM + cols, gl.sum(part, 0))
        i += 1


@gluon.jit
def gram_den_kernel(
    k_desc, s_desc, Z, PARTS, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks, k_batch_rows, n_items,
):  # fmt: skip
    k_smem, unused_smem, s_smem, ready, empty, s_ready, s_empty = allocate_stream(k_desc, k_desc, s_desc)
    # fmt: off
    gl.warp_specialize(
        [
            (_den_compute, (k_smem, s_smem, ready, empty, s_ready, s_empty, Z, PARTS, seqlen, n_seg,
                            segment_len, kv_heads, chunk, n_chunks, n_items, 0)),
            (_den_compute, (k_smem, s_smem, ready, empty, s_ready, s_empty, Z, PARTS, seqlen, n_seg,
                            segment_len, kv_heads, chunk, n_chunks, n_items, 1)),
            (stream_loader, (k_desc, k_desc, s_desc, k_smem, unused_smem, s_smem, ready, empty, s_ready,
                             s_empty, seqlen, n_seg, segment_len, kv_heads, 1, chunk, n_chunks, k_batch_rows,
                             k_batch_rows, n_items, False)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


def launch_gram_den(
    k: torch.Tensor, s_grad: torch.Tensor, z_before: torch.Tensor, segment_len: int, chunk: int
) -> torch.Tensor:
    """``memory.memory_gram_den_backward``'s result, (batch, segments, kv_heads, 128) float32: k
    (batch, seqlen, kv_heads, 128) bf16 in a layout ``dispatch.uses_infini_updates`` accepts;
    s_grad (batch, segments, kv_heads, 128, 128) bf16 and z_before (batch, segments, kv_heads,
    128) float32, contiguous; ``chunk`` rows per item, a multiple of 64."""
    b, s, kv_heads, d = k.shape
    n_seg = s_grad.shape[1]
    n_chunks = -(-min(segment_len, s) // chunk)
    n_items = b * n_seg * kv_heads * n_chunks
    kd, k_rows = token_descriptor(k, d)
    parts = torch.empty(b, n_seg, kv_heads, n_chunks * 2, d, device=k.device, dtype=torch.float32)
    programs = min(n_items, torch.cuda.get_device_properties(k.device).multi_processor_count)
    gram_den_kernel[(programs,)](
        kd, matrix_descriptor(s_grad), z_before, parts, s, n_seg, segment_len, kv_heads, chunk, n_chunks,
        k_rows, n_items, num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return parts.sum(3)
