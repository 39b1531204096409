"""Process groups for training: W = D x S ranks, sequence-parallel inside, data-parallel across."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import resolve_group


@dataclass(frozen=True)
class ParallelGroups:
    """Sequence-parallel groups are runs of ``sp_size`` consecutive ranks (e.g. one node);
    data-parallel groups join the ranks at the same position of every sequence-parallel group.
    ``mesh``: the same as a 2-D DeviceMesh with dims ("dp", "sp") (``mesh["sp"]`` is the
    sequence-parallel group, for ``group=`` arguments; FSDP2 shards over the whole of it)."""

    sp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    sp_size: int
    dp_size: int
    sp_rank: int
    dp_rank: int
    mesh: DeviceMesh | None = None


_GROUPS: dict[int, ParallelGroups] = {}


def sequence_parallel_groups(sp_size: int | None = None, *, mesh: DeviceMesh | None = None) -> ParallelGroups:
    """Split the world into data-parallel x sequence-parallel groups, as a (dp, sp) DeviceMesh.

    sp_size: ranks per sequence; the mesh is built with ``init_device_mesh`` (every rank of the
    world must make this call, with the same ``sp_size``, the first time; cached per sp_size).
    mesh: instead, a 2-D DeviceMesh with dims named "dp" and "sp" (e.g. from
    ``init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))``) to take the groups from.
    """
    resolve_group(None)
    if mesh is not None:
        if sp_size is not None:
            raise ValueError("pass sp_size or mesh, not both")
        return _groups_of(mesh)
    world = dist.get_world_size()
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
        raise ValueError(f"sp_size must be a positive int dividing the world size {world}, got {sp_size!r}")
    if sp_size not in _GROUPS:
        backend = str(dist.get_backend())
        device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
        # Row-major (dp, sp): sequence-parallel groups are runs of sp_size consecutive ranks.
        _GROUPS[sp_size] = _groups_of(
            init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
        )
    return _GROUPS[sp_size]


def _groups_of(mesh: DeviceMesh) -> ParallelGroups:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("dp", "sp"):
        raise ValueError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names ('dp', 'sp'), got {mesh!r}")
    return ParallelGroups(
        sp_group=mesh.get_group("sp"), dp_group=mesh.get_group("dp"),
        sp_size=mesh.size(1), dp_size=mesh.size(0),
        sp_rank=mesh.get_local_rank("sp"), dp_rank=mesh.get_local_rank("dp"), mesh=mesh,
    )  # fmt: skip


def reduce_gradients(module: torch.nn.Module, groups: ParallelGroups) -> None:
    """Make every parameter's .grad the gradient of the full-sequence loss, averaged over
    data-parallel replicas: sum the partial gradients of the ranks that share a sequence (each
    saw only its shard's tokens), then average across data-parallel groups. Call after
    ``backward`` with a loss from ``sequence_parallel_cross_entropy``."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if groups.sp_size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.sp_group)
    if groups.dp_size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.dp_group)
        flat /= groups.dp_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
