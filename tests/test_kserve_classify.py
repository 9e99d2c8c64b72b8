"""Triton's classification extension as the front door computes it (``kserve_classify``): the
ranking, the strings, the batch, and the types Triton cannot rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from batchyard.kserve_classify import classify, serialize_bytes
from batchyard.kserve_common import KServeError


def test_each_item_gets_its_largest_values_first_as_value_colon_index():
    x = np.array([[0.1, 0.7, 0.2], [3.0, -1.0, 2.5]], np.float32)
    assert classify(x, 2).tolist() == [[b"0.700000:1", b"0.200000:2"], [b"3.000000:0", b"2.500000:2"]]


def test_the_count_is_cut_to_an_items_elements_which_are_flattened():
    x = np.arange(12, dtype=np.int32).reshape(1, 3, 4)  # one item of 12 elements
    out = classify(x, 100)
    assert out.shape == (1, 12) and out[0, 0] == b"11:11" and out[0, -1] == b"0:0"


def test_integers_are_written_in_decimal_floats_as_cs_to_string_writes_them():
    assert classify(np.array([[2 ** 64 - 1, 7]], np.uint64), 1).tolist() == [[b"18446744073709551615:0"]]
    assert classify(np.array([[-5, -9]], np.int8), 2).tolist() == [[b"-5:0", b"-9:1"]]
    assert classify(np.array([[1e-7, 123456.5]], np.float64), 2).tolist() == [[b"123456.500000:1", b"0.000000:0"]]


def test_equal_values_are_ranked_by_index_also_where_the_count_cuts_them():
    assert classify(np.zeros((1, 6), np.float32), 3).tolist() == [[b"0.000000:0", b"0.000000:1", b"0.000000:2"]]
    x = np.array([[1, 5, 5, 0, 5, 5]], np.int64)
    assert classify(x, 3).tolist() == [[b"5:1", b"5:2", b"5:4"]]


@given(st.lists(st.sampled_from([0.0, 1.0, 2.0, float("nan")]), min_size=1, max_size=12), st.integers(1, 14))
def test_the_ranking_is_a_sort_by_value_then_index_with_nan_first(values, k):
    row = np.array(values)
    key = [(0 if np.isnan(v) else 1, 0.0 if np.isnan(v) else -v, i) for i, v in enumerate(values)]
    want = [i for *_, i in sorted(key)][:k]
    assert [int(s.split(b":")[1]) for s in classify(row[None], k)[0]] == want


@pytest.mark.parametrize("dtype, name", [(np.float16, "FP16"), (np.bool_, "BOOL")])
def test_types_triton_cannot_rank_are_refused_in_its_words(dtype, name):
    with pytest.raises(KServeError, match=f"class result not available for output due to unsupported type '{name}'"):
        classify(np.zeros((1, 3), dtype), 1)


def test_the_binary_form_is_each_strings_length_then_its_bytes():
    out = np.array([[b"ab", b""]], dtype=object)
    assert serialize_bytes(out) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
