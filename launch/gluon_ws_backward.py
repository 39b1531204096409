"""Experiment: the Gluon fused backward (gluon_fused_backward.py) with warp specialization.

The Eighth session's fused kernel did all of a tile pair's work in the same 8 compute warps:
TMA loads of the next Q/dO tile, the five products, the softmax gradient, the dQ tile's store
to shared memory and the wait for the previous tile's TMA reduce-add before that store. Its
diagnostics put the loss in the dQ path (store, reduce, waits), not the products. Here, as in
FA3, those jobs move to their own warps (``gl.warp_specialize``):

- loader, 1 warp: K/V once, then Q/dO tiles into a two-stage ring (ready/empty mbarriers);
- dQ writer, 1 warp: takes each float32 dQ tile from a two-buffer ring in shared memory and adds
  it into the dQ buffer with one TMA reduce-add, freeing the buffer once the reduce has read it;
- compute, 8 warps (two warpgroups), the default partition: per query tile S^T = K Q^T and
  dP^T = V dO^T, P^T and dS^T, dV += P^T dO, dQ = dS K, dK += dS^T Q. The dK product of one tile
  is left in flight while the next tile's S^T/dP^T are issued.

Workers get few registers (``WORKER_REGS``), so the compute warps can keep ~240 each.
Same restrictions as gluon_fused_backward.py: MHA, seqlen a multiple of 128, head_dim 64/128,
causal with aligned positions or no mask.

Measured on an H200 (2026-11-23, docs/performance.md, "Ninth session"): exact (dQ/dK/dV within
2.3e-3 to 2.6e-3 of float64, like our Triton kernels), and at head_dim 128 the first backward
faster than ours: 482 vs 413 TFLOP/s non-causal (1.17x), 448 vs 413 causal (1.09x); cuDNN 544/530.
At head_dim 64 a tie (0.99-1.00x). Not used by the library yet.

    python launch/gluon_ws_backward.py compile   # any machine: sm_90 build, spills in the loop
    python launch/gluon_ws_backward.py check     # GPU: dQ/dK/dV vs float64
    python launch/gluon_ws_backward.py bench     # GPU: TFLOP/s vs ours, the Eighth session's, cuDNN
"""

# No "from __future__ import annotations": Gluon aggregates check their fields against real types.

import torch
from gluon_fused_backward import LOG2E, _descs, compile_gluon_for_hopper, store_dkdv, tma_reduce_add
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

WORKER_REGS = gl.constexpr(24)


@aggregate
class Shared:
    """What the partitions share: descriptors, shared-memory rings and their barriers, and the
    program's coordinates (row0: its sequence's first row in the (B*S, H*D) views)."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    dq_desc: tma.tensor_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    qdo_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    row0: gl.tensor
    n0: gl.tensor
    lo: gl.tensor
    col: gl.tensor
    n_tiles: gl.tensor

    @gluon.constexpr_function
    def __init__(
        self,
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dq_desc,
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        ds_smem,
        dq_smem,
        kv_bar,
        qdo_ready,
        qdo_empty,
        dq_ready,
        dq_empty,
        row0,
        n0,
        lo,
        col,
        n_tiles,
    ):
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.do_desc = do_desc
        self.dq_desc = dq_desc
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_smem = q_smem
        self.do_smem = do_smem
        self.ds_smem = ds_smem
        self.dq_smem = dq_smem
        self.kv_bar = kv_bar
        self.qdo_ready = qdo_ready
        self.qdo_empty = qdo_empty
        self.dq_ready = dq_ready
        self.dq_empty = dq_empty
        self.row0 = row0
        self.n0 = n0
        self.lo = lo
        self.col = col
        self.n_tiles = n_tiles


@gluon.jit
def _load_partition(p: Shared, BLOCK_M: gl.constexpr):
    mbarrier.expect(p.kv_bar, 2 * p.k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(p.k_desc, [p.row0 + p.n0, p.col], p.kv_bar, p.k_smem)
    tma.async_copy_global_to_shared(p.v_desc, [p.row0 + p.n0, p.col], p.kv_bar, p.v_smem)
    tile_bytes: gl.constexpr = 2 * p.q_desc.block_type.nbytes
    for i in range(p.n_tiles):
        s = i % 2
        # mbarriers start in phase 1 complete: the first wait on each empty slot passes.
        mbarrier.wait(p.qdo_empty.index(s), ((i // 2) & 1) ^ 1)
        bar = p.qdo_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        row = p.row0 + p.lo + i * BLOCK_M
        tma.async_copy_global_to_shared(p.q_desc, [row, p.col], bar, p.q_smem.index(s))
        tma.async_copy_global_to_shared(p.do_desc, [row, p.col], bar, p.do_smem.index(s))


@gluon.jit
def _dq_partition(p: Shared, BLOCK_M: gl.constexpr):
    for i in range(p.n_tiles):
        j = i % 2
        mbarrier.wait(p.dq_ready.index(j), (i // 2) & 1)
        tma_reduce_add(p.dq_desc, [p.row0 + p.lo + i * BLOCK_M, p.col], p.dq_smem.index(j))
        tma.store_wait(1)  # the previous tile's reduce has read its buffer
        mbarrier.arrive(p.dq_empty.index(1 - j), count=1, pred=i > 0)
    tma.store_wait(0)


@gluon.jit
def _compute_tile(
    p: Shared, i, dk, dv, st_zero, dq_zero, offs_n, LSE, DELTA, lse_row, qk_scale,
    a_layout: gl.constexpr, qcol_layout: gl.constexpr, BLOCK_M: gl.constexpr, MASKED: gl.constexpr,
):  # fmt: skip
    """Query tile i: dV and dK (left in flight) added to dv/dk, its dQ tile handed to the writer."""
    dtype: gl.constexpr = p.q_desc.dtype
    s = i % 2
    m0 = p.lo + i * BLOCK_M
    mbarrier.wait(p.qdo_ready.index(s), (i // 2) & 1)
    q_s = p.q_smem.index(s)
    do_s = p.do_smem.index(s)
    st = warpgroup_mma(p.k_smem, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(p.v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    # In flight, oldest first: the previous tile's dK, S^T, dP^T. Under CAUSAL, ptxas's C7512
    # (every wgmma serialized) came and went with the order of these waits (docs: Ninth session).
    dk = warpgroup_mma_init(warpgroup_mma_wait(2, deps=(dk,)))
    if i > 0:  # the previous tile's dK product has read its Q stage
        mbarrier.arrive(p.qdo_empty.index(1 - s), count=1)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=qcol_layout)
    lse2 = gl.load(LSE + lse_row + offs_m) * 1.4426950408889634
    delta = gl.load(DELTA + lse_row + offs_m)
    s_t = warpgroup_mma_wait(1, deps=(st,))
    if MASKED:  # on S, not P: masking P after the exp cost ~1% (C7512, see above)
        s_t = gl.where(offs_n[:, None] <= offs_m[None, :], s_t, -float("inf"))
    pt = gl.exp2(s_t * qk_scale - lse2[None, :])
    dp_t = warpgroup_mma_wait(0, deps=(dpt,))
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
    dst16 = (pt * (dp_t - delta[None, :])).to(dtype)
    p.ds_smem.store(dst16)
    fence_async_shared()
    mbarrier.wait(p.dq_empty.index(s), ((i // 2) & 1) ^ 1)
    # wgmma groups retire in issue order: dK goes after dQ so that it can stay in flight.
    dq = warpgroup_mma(p.ds_smem.permute((1, 0)), p.k_smem, dq_zero, use_acc=False, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_s, dk, is_async=True)
    dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
    p.dq_smem.index(s).store(dq)
    fence_async_shared()
    mbarrier.arrive(p.dq_ready.index(s), count=1)
    return dk, dv


@gluon.jit
def _compute_partition(
    p: Shared, LSE, DELTA, lse_row, qk_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, HEAD_DIM // (num_warps // 4), 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    qcol_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    # dK is carried through the loops as an in-flight product (see _compute_tile).
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    offs_n = p.n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    # Causal: the first BLOCK_N // BLOCK_M query tiles cross the diagonal, and only they are
    # masked, in a loop of their own, so the main loop carries no mask registers.
    n_masked = BLOCK_N // BLOCK_M if CAUSAL else 0
    mbarrier.wait(p.kv_bar, 0)
    for i in range(n_masked):
        dk, dv = _compute_tile(
            p, i, dk, dv, st_zero, dq_zero, offs_n, LSE, DELTA, lse_row, qk_scale, a_layout, qcol_layout,
            BLOCK_M, True,
        )  # fmt: skip
    for i in range(n_masked, p.n_tiles):
        dk, dv = _compute_tile(
            p, i, dk, dv, st_zero, dq_zero, offs_n, LSE, DELTA, lse_row, qk_scale, a_layout, qcol_layout,
            BLOCK_M, False,
        )  # fmt: skip
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _bwd_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, LSE, DELTA,
    seqlen, heads, qk_scale, softmax_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    pid_n = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * BLOCK_N
    row0 = b * seqlen
    col = h * HEAD_DIM
    dtype: gl.constexpr = q_desc.dtype
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=1)
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)

    if CAUSAL:
        lo = n0
    else:
        lo = 0
    n_tiles = (seqlen - lo) // BLOCK_M
    p = Shared(
        q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem,
        kv_bar, qdo_ready, qdo_empty, dq_ready, dq_empty, row0, n0, lo, col, n_tiles,
    )  # fmt: skip
    lse_row = (b * heads + h).to(gl.int64) * seqlen
    dk, dv = gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    p,
                    LSE,
                    DELTA,
                    lse_row,
                    qk_scale,
                    BLOCK_M,
                    BLOCK_N,
                    HEAD_DIM,
                    CAUSAL,
                    num_warps,
                ),
            ),
            (_load_partition, (p, BLOCK_M)),
            (_dq_partition, (p, BLOCK_M)),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    store_dkdv(DK, DV, dk, dv, row0 + n0, col, heads, softmax_scale, BLOCK_N, HEAD_DIM)


def ws_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    *,
    block_m: int = 64,
    block_n: int = 128,
    maxnreg: int = 168,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) like q/k/v. q/k/v/do: (batch, seqlen, heads, head_dim) contiguous bf16/fp16;
    lse, delta: (batch, heads, seqlen) float32. ``maxnreg``: the register cap at entry, which
    warp specialization redistributes (12 warps x 32 x 168 fills the 64K register file)."""
    B, S, H, D = q.shape
    if S % block_n or k.shape != q.shape or v.shape != q.shape or D not in (64, 128):
        raise ValueError(
            f"needs MHA shapes with seqlen % {block_n} == 0 and head_dim 64 or 128, got {q.shape}"
        )
    lse, delta = lse.contiguous(), delta.contiguous()
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    qd, kd, vd, dod, dqd = _descs(q, k, v, do, dq_acc, block_m, block_n)
    _bwd_ws_kernel[(S // block_n, H, B)](
        qd, kd, vd, dod, dqd, dk, dv, lse, delta, S, H, softmax_scale * LOG2E, softmax_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, CAUSAL=causal,
        num_warps=8, maxnreg=maxnreg,
    )  # fmt: skip
    return (dq_acc * softmax_scale).to(q.dtype), dk, dv


def compile_ws_for_hopper(head_dim: int, causal: bool, maxnreg: int = 168, block_m: int = 64):
    """Build the kernel for sm_90 without a GPU; returns the compiled kernel."""
    return compile_gluon_for_hopper(
        _bwd_ws_kernel, head_dim, block_m, {}, dict(CAUSAL=causal), maxnreg=maxnreg
    )


# block_m per head_dim (block_n is 128).
WS_VARIANTS = {128: [64], 64: [64, 128]}


def _variant_name(bm: int) -> str:
    return f"ws {bm}"


def check() -> bool:
    """Every variant against float64 attention, with fresh inputs per case; NaN fails."""
    from gluon_fused_backward import _inputs, _rel, reference_grads

    ok_all = True
    for D in (128, 64):
        for causal in (False, True):
            for S in (1024, 384):
                q, k, v, do, lse, delta, _ = _inputs(2, S, 3, D, causal, seed=S + D + causal)
                ref = reference_grads(q, k, v, do, causal)
                for bm in WS_VARIANTS[D]:
                    if S % bm:
                        continue
                    grads = ws_backward(q, k, v, do, lse, delta, D**-0.5, causal, block_m=bm)
                    errs = [_rel(x, r) for x, r in zip(grads, ref)]
                    ok = not any(torch.isnan(x).any().item() for x in grads) and max(errs) < 2e-2
                    ok_all &= ok
                    print(
                        f"{_variant_name(bm)} D={D} S={S} causal={causal}: dq/dk/dv rel. error "
                        + " ".join(f"{e:.2e}" for e in errs) + (" OK" if ok else " FAIL"),
                        flush=True,
                    )  # fmt: skip
    return ok_all


def bench(seqlens: list[int], head_dims: list[int], tokens: int = 65536, H: int = 16) -> None:
    """Backward TFLOP/s (2.5x forward FLOPs), side by side: our Triton kernels, the Eighth
    session's Gluon kernel (pipelined mode 0, in-order mode 5), these variants, cuDNN."""
    import functools

    import torch.nn.functional as F
    import triton
    from gluon_fused_backward import _inputs, gluon_backward
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ringflash.kernels import attention_backward

    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for D in head_dims:
        for S in seqlens:
            B = max(1, tokens // S)
            for causal in (False, True):
                q, k, v, do, lse, delta, problem = _inputs(B, S, H, D, causal)
                flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
                fns = {"ours": functools.partial(attention_backward, do, q, k, v, lse, delta, problem)}
                bm0 = 64 if D == 128 else 128
                args = (q, k, v, do, lse, delta, D**-0.5, causal)
                fns["gluon p0"] = functools.partial(gluon_backward, *args, block_m=bm0, pipeline=True)
                if D == 128:
                    fns["gluon m5"] = functools.partial(
                        gluon_backward, *args, block_m=64, pipeline=False, dq_mode=5
                    )
                for bm in WS_VARIANTS[D]:
                    fns[_variant_name(bm)] = functools.partial(ws_backward, *args, block_m=bm)
                qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                g = do.transpose(1, 2).contiguous()
                fns["cudnn"] = functools.partial(torch.autograd.grad, o, (qs, ks, vs), g, retain_graph=True)
                res = {}
                for name, fn in fns.items():
                    try:
                        res[name] = flops / triton.testing.do_bench(fn, return_mode="median") * 1e-9
                    except Exception as e:  # a variant that fails to build must not hide the others
                        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                print(
                    f"D={D} S={S} B={B} causal={causal}: "
                    + ", ".join(f"{n} {t:.0f}" for n, t in res.items()),
                    flush=True,
                )
                ws = {n: t for n, t in res.items() if n.startswith("ws")}
                best = max(ws, key=ws.get) if ws else None
                rows.append((D, S, causal, res.get("ours", 0), best, ws.get(best, 0), res.get("cudnn", 0)))
    print("\n| head_dim | S | causal | ours | warp-specialized (best) | cuDNN | ws / ours | ws / cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for D, S, c, ours, name, t, cudnn in rows:
        print(
            f"| {D} | {S} | {c} | {ours:.0f} | {t:.0f} ({name}) | {cudnn:.0f} | "
            f"{t / ours:.2f} | {t / cudnn:.2f} |"
        )


def compile_report(head_dims: list[int]) -> None:
    from gluon_fused_backward import loop_spills

    from ringflash.kernels.offline_compile import resource_usage

    for D in head_dims:
        for causal in (False, True):
            for bm in WS_VARIANTS[D]:
                k = compile_ws_for_hopper(D, causal, block_m=bm)
                u, (stl, ldl) = resource_usage(k), loop_spills(k)
                print(
                    f"{_variant_name(bm)} head_dim {D} causal={causal}: {stl}/{ldl} spill "
                    f"stores/loads in the main loop, {u.shared_bytes} B shared memory",
                    flush=True,
                )


if __name__ == "__main__":
    from gluon_fused_backward import run_cli

    run_cli(__doc__, compile_report, check, bench)
