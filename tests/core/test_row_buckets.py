"""Eager cuBLAS GEMMs padded to a row count graph capture already ran (``row_buckets``)."""

import pytest

from openinfer.backend.cuda.row_buckets import padded_rows

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 271)


@pytest.mark.parametrize("rows, expected", [(1, 1), (3, 4), (8, 8), (9, 16), (17, 24), (200, 256), (257, 271),
                                            (272, 272), (8192, 8192)])
def test_padded_rows_takes_the_smallest_bucket_that_holds_them(rows, expected):
    assert padded_rows(rows, BUCKETS) == expected


def test_no_buckets_no_padding():
    assert padded_rows(37, ()) == 37
