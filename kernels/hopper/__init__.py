"""The Hopper (sm_90) kernels, written in Gluon (warp-specialized, TMA, wgmma).

- ``dispatch``: when they run instead of the Triton kernels (the one place that decides);
- ``forward``, ``backward``: the attention forward and the fused backward; ``dq``: dQ of the
  head_dim-256 build, by a kernel of its own;
- ``query_tiles``: the work over query tiles that the forward (persistent programs) and ``dq``
  (a program per tile) run (warps, shared memory, the key tiles walked, launch arguments);
  ``scores``: masks, softcap and ALiBi applied to a tile of scores;
- ``spans``: which tiles a program visits (positions, windows);
- ``tma``: the TMA descriptors and tile copies both use (head dims between their builds read
  as the next build's tiles, zero-filled);
- ``named_barriers``: hand-overs between warp-specialized partitions by named barriers;
- ``infini_retrieval``, ``infini_updates``: Infini-attention's retrieval and its memory
  updates, forward and backward, bf16 at head_dim 128.

Only ``dispatch`` imports without Gluon; the kernel modules are imported on first
use (``dispatch.hopper_module``), never under the interpreter.
"""
