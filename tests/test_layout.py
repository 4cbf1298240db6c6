import numpy as np
import pytest

from r3cache import RoutingLayout
from r3cache.errors import ContractError, LayoutError, LayoutMismatchError


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [(1, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.int32)],
)
def test_dtype_is_the_narrowest_that_holds_every_expert_id(experts, dtype):
    layout = RoutingLayout(num_layers=2, topk=1, num_experts=experts)
    assert layout.dtype == np.dtype(dtype)
    assert np.iinfo(layout.dtype).max >= experts - 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0, "topk": 1, "num_experts": 8}, "num_layers must be positive"),
        ({"num_layers": 2, "topk": -1, "num_experts": 8}, "topk must be positive"),
        ({"num_layers": 2, "topk": 1, "num_experts": 0}, "num_experts must be positive"),
        (
            {"num_layers": 2, "topk": 1, "num_experts": 8, "block_size": 0},
            "block_size must be positive",
        ),
        ({"num_layers": 2, "topk": 9, "num_experts": 8}, "topk (9) cannot exceed num_experts (8)"),
        ({"num_layers": 2.0, "topk": 1, "num_experts": 8}, "num_layers must be an int"),
    ],
)
def test_invalid_layouts_raise_clear_typed_errors(kwargs, message):
    with pytest.raises(LayoutError) as info:
        RoutingLayout(**kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ContractError)


def test_fingerprint_is_stable_and_round_trips():
    layout = RoutingLayout(48, 8, 128, 16)
    assert layout.fingerprint == "r3l1:L48:K8:E128:B16:|u1"
    assert RoutingLayout.from_fingerprint(layout.fingerprint) == layout
    assert RoutingLayout(48, 8, 129, 16).fingerprint != layout.fingerprint
    # A dtype the sizes do not store in would decode every block wrongly.
    for bad in ("L48:K8", "r3l1:L48:K8:E128:B16:|f4", "r3l1:L48:K8:E128:B16:<u2", None):
        with pytest.raises(LayoutMismatchError):
            RoutingLayout.from_fingerprint(bad)


def test_check_rows_rejects_wrong_shapes_and_dtypes():
    layout = RoutingLayout(3, 2, 16)
    layout.check_rows(np.zeros((5, 3, 2), np.uint8))
    for bad in (np.zeros((5, 3, 2), np.int64), np.zeros((5, 2, 3), np.uint8),
                np.zeros((3, 2), np.uint8), [[0, 1]]):
        with pytest.raises(LayoutMismatchError):
            layout.check_rows(bad)
    assert layout.empty_rows(4).shape == (4, 3, 2)
    for bad in (1.5, -1, "4"):
        with pytest.raises(LayoutError, match="num_tokens must be an int"):
            layout.empty_rows(bad)


# Eight-byte rows (topk 8 of uint8, 4 of uint16, 2 of int32) take the compiled kernel;
# the others numpy's one compare of all columns (few rows) or topk - 1 compares.
@pytest.mark.parametrize("topk,num_experts", [(8, 128), (8, 256), (4, 512), (2, 1 << 20),
                                              (6, 128), (8, 512)])
@pytest.mark.parametrize("num_rows", [1, 64, 700])
def test_an_expert_named_twice_is_found_in_any_pair_of_columns(num_rows, topk, num_experts):
    from r3cache.layout import repeats_an_expert
    from r3cache.sim import oracle_rows

    layout = RoutingLayout(num_layers=48, topk=topk, num_experts=num_experts)
    rows = oracle_rows(list(range(num_rows)), layout)
    assert layout.id_problem(rows) is None
    assert layout.id_problem(rows[:, ::2]) is None  # not contiguous
    for i in range(topk):
        for j in range(topk):
            if i == j:
                continue
            bad = rows.copy()
            bad[num_rows // 2, 47, j] = bad[num_rows // 2, 47, i]
            assert repeats_an_expert(bad), (i, j)
            assert layout.id_problem(bad) == "a row names the same expert twice"
            assert repeats_an_expert(bad[:, 40:]), (i, j)


def test_ids_compare_as_values_in_every_lane_whatever_their_bits():
    """Experts that differ only in a lane's high bit, or are 0 next to a large one, are
    different; the largest IDs of each dtype repeat like any other."""
    from r3cache.layout import repeats_an_expert

    for dtype, topk in ((np.uint8, 8), (np.uint16, 4), (np.int32, 2)):
        top = np.iinfo(dtype).max
        half = (top + 1) // 2
        distinct = np.array([0, half, 1, half + 1, top, top - 1, 2, half + 2][:topk], dtype)
        assert not repeats_an_expert(distinct.reshape(1, 1, topk)), dtype
        for value in (0, half, top):
            twice = distinct.copy()
            twice[:2] = value
            assert repeats_an_expert(twice.reshape(1, 1, topk)), (dtype, value)


@pytest.mark.parametrize("topk,num_experts", [
    (8, 8), (8, 127), (8, 128), (8, 129), (8, 200), (8, 255), (8, 256),
    (4, 257), (4, 32767), (4, 32768), (4, 32769), (4, 65535), (4, 65536),
    (2, 65537), (2, 1 << 20)])
def test_every_id_outside_the_range_is_found_in_any_lane(topk, num_experts):
    """The compiled check of eight-byte rows against numpy's comparison, for IDs on either
    side of num_experts, of half the lane, of the lane's top and (int32) below zero."""
    layout = RoutingLayout(num_layers=1, topk=topk, num_experts=num_experts)
    info = np.iinfo(layout.dtype)
    half = (int(info.max) + 1) // 2
    values = {0, 1, num_experts - 2, num_experts - 1, num_experts, num_experts + 1,
              half - 1, half, half + 1, int(info.max) - 1, int(info.max), -1, int(info.min)}
    values = sorted(v for v in values if info.min <= v <= info.max)
    distinct = np.arange(topk, dtype=layout.dtype) + (1000 % max(num_experts - topk, 1))
    for value in values:
        for lane in range(topk):
            rows = np.tile(distinct, (3, 1, 1))
            rows[1, 0, lane] = value
            outside = value < 0 or value >= num_experts
            named_twice = not outside and value in np.delete(distinct, lane)
            expected = ("expert IDs outside" if outside
                        else "a row names the same expert twice" if named_twice else None)
            problem = layout.id_problem(rows)
            assert problem == expected or problem.startswith(expected), (value, lane)
