"""Named hardware barriers (``bar.arrive`` / ``bar.sync``) between warp-specialized partitions.

An mbarrier arrive in Gluon is issued by one thread of its partition, so the compiler puts a
``bar.sync`` of the whole partition before it: every warp waits for the slowest before any
can go on. Where compute warps hand a buffer to a one-warp worker (the backward's Q/dO stages
back to the loader, its dQ tiles to the writer), a named barrier does the same hand-over with
no wait on the compute side: each compute thread ``arrive``s (no wait; its earlier memory
accesses are performed for the barrier's participants), and the worker ``sync``s, waiting
until all ``count`` threads have arrived. This is how FlashAttention-3 hands its dQ tiles over.

A named barrier has no phases: a warp must not arrive twice on the same barrier before the
barrier completes. Users alternate two barriers between the two slots of a ring, so that a
slot's next hand-over cannot start before the worker has taken the last one (each user's
docstring says why), and every arrive is matched by a sync.

The compiler numbers its own barriers from 0 (0-2 in these kernels' sm_90 builds); the kernels
take theirs from ``FIRST_ID`` up.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

FIRST_ID = gl.constexpr(8)  # hardware has 16 named barriers per CTA


@gluon.jit
def arrive(bar_id, count: gl.constexpr, pred):
    """Every thread of the partition arrives at named barrier ``bar_id`` (counting ``count``
    threads in all) without waiting, where ``pred`` (a boolean scalar, uniform across the
    partition) holds."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p bar.arrive $1, $2; mov.b32 $0, 0; }",
        "=r,r,r,r",
        [bar_id, bar_id * 0 + count, pred.to(gl.int32)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def sync(bar_id, count: gl.constexpr):
    """Every thread of the partition arrives at named barrier ``bar_id`` and waits until
    ``count`` threads in all have arrived."""
    gl.inline_asm_elementwise(
        "bar.sync $1, $2; mov.b32 $0, 0;",
        "=r,r,r",
        [bar_id, bar_id * 0 + count],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )
