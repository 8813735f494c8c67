"""Token ids: a sequence of ints held as little-endian int32 bytes, and what is not one refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tokenbudget.streams.fields import TokenIds


def test_token_ids_behave_like_a_sequence_of_ints() -> None:
    ids = TokenIds([5, 6, 7, 8])
    assert len(ids) == 4 and ids[0] == 5 and ids[-1] == 8 and isinstance(ids[1], int)
    assert ids == [5, 6, 7, 8] and ids == (5, 6, 7, 8)
    assert [5, 6, 7, 8] == ids  # noqa: SIM300 - list.__eq__ defers to TokenIds
    assert ids != [5, 6, 7] and ids != "abcd" and ids != b"\x05"
    assert ids[1:3] == TokenIds([6, 7]) and isinstance(ids[::2], TokenIds)
    assert ids[::-1] == [8, 7, 6, 5]
    assert list(ids) == ids.tolist() == [5, 6, 7, 8] and 7 in ids
    assert TokenIds(ids) == ids and hash(TokenIds(ids)) == hash(ids)
    assert TokenIds(i for i in range(3)) == [0, 1, 2]
    assert TokenIds() == [] and len(TokenIds([])) == 0
    assert repr(ids) == "TokenIds([5, 6, 7, 8])"
    assert ids.tobytes() == np.array([5, 6, 7, 8], "<i4").tobytes()
    assert TokenIds.from_bytes(ids.tobytes()) == ids
    array = np.asarray(ids)
    assert array.dtype == np.int32 and array.tolist() == [5, 6, 7, 8]
    with pytest.raises(ValueError):
        array[0] = 1  # a view of the immutable bytes


@pytest.mark.parametrize("bad", [[1.5], [True, False], [[1]], [2**31], [-(2**31) - 1], [2**70]])
def test_token_ids_reject_what_is_not_int32(bad: list[Any]) -> None:
    with pytest.raises(ValueError, match="output_ids"):
        TokenIds(bad)


def test_token_ids_from_bytes_needs_whole_int32s() -> None:
    with pytest.raises(ValueError, match="not a whole number of int32"):
        TokenIds.from_bytes(b"\x01\x00\x00")
