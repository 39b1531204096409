"""ringflash.mesh: the Ulysses x ring mesh of a group, made once per group (by identity)."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from ringflash import mesh
from ringflash.mesh import check_ulysses_size, mode_ulysses_size, ulysses_ring_mesh


def _meshes_on_rank():
    world = dist.group.WORLD
    first = ulysses_ring_mesh(world, 2)
    again = ulysses_ring_mesh(None, 2) is first  # the default group is the world
    sizes = (first.ulysses_size, first.ring_size, dist.get_world_size(first.ulysses_group),
             dist.get_world_size(first.ring_group))  # fmt: skip
    other = dist.new_group([0, 1, 2, 3])  # the same ranks, another group: its own subgroups
    made = ulysses_ring_mesh(other, 2)
    distinct = made is not first and made.ulysses_group is not first.ulysses_group
    entries = len(mesh._MESHES)
    dist.destroy_process_group(other)
    del other, made
    gc.collect()
    return again, sizes, distinct, entries - len(mesh._MESHES)


def test_a_mesh_per_group_dropped_with_it(rank_pool):
    for again, sizes, distinct, dropped in rank_pool(4).run(_meshes_on_rank):
        assert again and sizes == (2, 2, 2, 2)
        assert distinct and dropped == 1


def test_ulysses_sizes_of_each_mode():
    assert mode_ulysses_size("ulysses", None, 4) == 4 and mode_ulysses_size("hybrid", 2, 4) == 2
    with pytest.raises(ValueError, match='ulysses_size=2 contradicts sp_mode="ulysses"'):
        mode_ulysses_size("ulysses", 2, 4)
    with pytest.raises(ValueError, match="must divide"):
        check_ulysses_size(3, 4)
    with pytest.raises(TypeError, match="positive int"):
        check_ulysses_size(True, 4)
