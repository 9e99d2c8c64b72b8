"""Triton's classification extension as the front door computes it (``kserve_classify``): the
ranking, the strings, the batch, and the types Triton cannot rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from batchyard.kserve_classify import MAX_ITEM_ELEMENTS, Abandoned, class_count, ranked, ranked_off_loop, serialize_bytes
from batchyard.kserve_common import KServeError


def classify(arr: np.ndarray, count: int) -> np.ndarray:
    """The classification's strings as bytes, in its shape (what the binary form carries)."""
    shape, strings = ranked(arr, count, False)
    out = np.empty(shape, dtype=object)
    out.reshape(-1)[:] = [s.encode() for s in strings]
    return out


def test_each_item_gets_its_largest_values_first_as_value_colon_index():
    x = np.array([[0.1, 0.7, 0.2], [3.0, -1.0, 2.5]], np.float32)
    assert classify(x, 2).tolist() == [[b"0.700000:1", b"0.200000:2"], [b"3.000000:0", b"2.500000:2"]]


def test_the_count_is_cut_to_an_items_elements_which_are_flattened():
    x = np.arange(12, dtype=np.int32).reshape(1, 3, 4)  # one item of 12 elements
    out = classify(x, 100)
    assert out.shape == (1, 12) and out[0, 0] == b"11:11" and out[0, -1] == b"0:0"


def _glibc_f(v: float) -> bytes:
    """What C's std::to_string writes of ``v``: glibc's %f."""
    import ctypes

    buf = ctypes.create_string_buffer(512)
    ctypes.CDLL(None).snprintf(buf, 512, b"%f", ctypes.c_double(v))
    return buf.value


def test_floats_are_written_as_glibcs_percent_f_the_sign_of_a_nan_too():
    """Python's %f drops a NaN's sign, glibc's (Triton's std::to_string) writes "-nan": what 0/0
    and inf - inf give on x86 (a review found the front door writing "nan" where Triton wrote "-nan")."""
    with np.errstate(invalid="ignore"):
        computed_nan = np.float32(np.inf) - np.float32(np.inf)
    values = [computed_nan, -computed_nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, 3.4028235e38, -2.5, 0.1, 123456.789]
    for dtype in (np.float32, np.float64):
        x = np.array(values, dtype)
        for s in classify(x[None], len(values))[0]:
            text, index = s.rsplit(b":", 1)
            assert text == _glibc_f(float(x[int(index)])), (s, x[int(index)])


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


def test_a_count_is_kept_as_tritons_uint32_and_zero_classes_is_an_empty_item():
    assert [class_count(n) for n in (5, 2**32, 2**32 + 1, 2**63 - 1)] == [5, 0, 1, 2**32 - 1]
    assert classify(np.ones((2, 3), np.float32), 0).shape == (2, 0)


def test_an_item_past_tritons_million_elements_is_refused_before_it_is_ranked():
    with pytest.raises(KServeError, match="classification output tensor too large"):
        classify(np.zeros((1, MAX_ITEM_ELEMENTS + 1), np.float32), 1)
    assert classify(np.zeros((1, MAX_ITEM_ELEMENTS), np.float32), 1).shape == (1, 1)


@pytest.mark.parametrize("shape, k", [((2, 6), 3), ((4, 300_000), 5), ((3, 1000), 1000), ((2, 200_000), 200_000),
                                      ((0, 5), 3)])
@pytest.mark.parametrize("binary", [True, False])
def test_a_ranking_off_the_loop_is_the_same(shape, k, binary):
    import asyncio
    import concurrent.futures

    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    labels = classify(x, k)
    want = serialize_bytes(labels.reshape(-1)) if binary else [s.decode() for s in labels.reshape(-1)]
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        assert asyncio.run(ranked_off_loop(x, k, binary, executor)) == ranked(x, k, binary) == (list(labels.shape), want)


@pytest.mark.parametrize("dtype, name", [(np.float16, "FP16"), (np.bool_, "BOOL")])
def test_types_triton_cannot_rank_are_refused_in_its_words(dtype, name):
    with pytest.raises(KServeError, match=f"class result not available for output due to unsupported type '{name}'"):
        classify(np.zeros((1, 3), dtype), 1)


def test_the_binary_form_is_each_strings_length_then_its_bytes():
    assert serialize_bytes([b"ab", b""]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def test_an_abandoned_ranking_stops_before_its_next_item_or_chunk():
    import threading

    abandoned = threading.Event()
    abandoned.set()
    with pytest.raises(Abandoned):
        ranked(np.zeros((2, 10), np.float32), 3, True, abandoned)
    assert ranked(np.zeros((2, 10), np.float32), 3, True, threading.Event())[0] == [2, 3]


def test_a_cancelled_caller_abandons_its_ranking():
    """Run to its end, an abandoned ranking held the one ranking thread: the next client's waited
    3.6 s behind 16 items of a million classes (a review's probe)."""
    import asyncio
    import concurrent.futures

    class Held:  # an executor whose job never ends by itself
        def submit(self, fn, *args):
            self.args = args
            return concurrent.futures.Future()

    async def go(executor):
        call = asyncio.ensure_future(ranked_off_loop(np.zeros((4, 300_000), np.float32), 5, True, executor))
        while not hasattr(executor, "args"):
            await asyncio.sleep(0)  # (a yield to the loop, which starts the call)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    executor = Held()
    asyncio.run(go(executor))
    assert executor.args[-1].is_set()
