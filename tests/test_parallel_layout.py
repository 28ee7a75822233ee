"""The 2-D layout's arithmetic (tp splits first, dp splits the TP-local tensor, as torch.chunk)
against DTensor's own reading of the placements funcshard stores (``_StridedShard`` included),
for uneven sizes and every rank: what ``full_tensor()``, DCP and ``redistribute`` rely on."""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from funcshard._trees._parallel import check_composable, storage_placements
from funcshard._trees._spec import ShardSpec


class _Grid:
    """The part of a DeviceMesh a ShardSpec reads: sizes and this rank's coordinate."""

    def __init__(self, shape, coord) -> None:
        self.shape, self.ndim, self.coord = shape, len(shape), coord

    def size(self, i: int) -> int:
        return self.shape[i]

    def get_coordinate(self):
        return list(self.coord)


class _Names(_Grid):
    mesh_dim_names = ("dp", "tp")

    def __init__(self, shape) -> None:
        super().__init__(shape, (0,) * len(shape))


PLACEMENTS = [Shard(0), Shard(1), Replicate()]


@pytest.mark.parametrize(("dp", "tp"), [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("tp_placement", PLACEMENTS)
@pytest.mark.parametrize("dp_placement", PLACEMENTS)
def test_2d_layout_is_dtensors(dp, tp, tp_placement, dp_placement):
    for shape in itertools.product(range(1, 10), (1, 5)):
        placements = storage_placements((dp_placement, tp_placement), (0,), (dp, tp))
        try:
            check_composable("w", shape, (dp_placement, tp_placement), (0,), _Names((dp, tp)))
        except ValueError:  # tp splits the dp dim unevenly: refused, checked below
            assert placements[0] != dp_placement and shape[dp_placement.dim] % tp
            continue
        for coord in itertools.product(range(dp), range(tp)):
            spec = ShardSpec(_Grid((dp, tp), coord), placements, shape, (shape[1], 1), (0,))
            theirs = _compute_local_shape_and_global_offset(shape, (dp, tp), list(coord),
                                                            placements)  # fmt: skip
            ours = (spec.level_shapes()[-1], spec.local_offset())
            if 0 in ours[0]:  # an empty shard: DTensor's offset is the dim's end, ours any
                assert 0 in theirs[0], (shape, coord, placements, ours, theirs)
                continue
            assert ours == theirs, (shape, coord, placements)


def test_uneven_tp_split_under_dp_is_refused_where_dtensor_misreads_it():
    """7 rows over tp 2 (4 and 3), then over dp 3: DTensor's _StridedShard puts nothing on the
    last dp rank of tp rank 1, torch.chunk puts row 6 there -- refused, with the fix."""
    placements = storage_placements((Shard(0), Shard(0)), (0,), (3, 2))
    spec = ShardSpec(_Grid((3, 2), (2, 1)), placements, (7, 1), (1, 1), (0,))
    theirs = _compute_local_shape_and_global_offset((7, 1), (3, 2), [2, 1], placements)
    assert spec.level_shapes()[-1] == (1, 1) and theirs[0] == (0, 1)  # the misreading
    with pytest.raises(ValueError, match=r"unequal parts \(7 over 2\).*another dim"):
        check_composable("w", (7, 1), (Shard(0), Shard(0)), (0,), _Names((3, 2)))
