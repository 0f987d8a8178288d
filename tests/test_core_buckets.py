"""Unit tests of bucket ladders."""
import pytest

import padgraph as pg


def test_explicit_and_multiple_of():
    b = pg.Buckets([1, 2, 4, 8])
    assert isinstance(b, tuple) and b.largest == 8 and repr(b) == "Buckets([1, 2, 4, 8])"
    assert list(pg.Buckets([8, 16, 24], multiple_of=8)) == [8, 16, 24]
    assert list(pg.Buckets((3,))) == [3]


@pytest.mark.parametrize("sizes", [[], [0], [-2, 1], [1, 1], [2, 1], [1.0], [True], ["2"], 5, None])
def test_invalid(sizes):
    with pytest.raises(pg.ContractValueError):     # a ValueError (SPEC 3.3) and a ContractError
        pg.Buckets(sizes)


@pytest.mark.parametrize("multiple_of", [0, -8, 8.0, True, "8"])
def test_invalid_multiple_of(multiple_of):
    with pytest.raises(pg.ContractValueError, match="multiple_of must be an int >= 1"):
        pg.Buckets([8, 16], multiple_of=multiple_of)


@pytest.mark.parametrize("make", [lambda m: pg.Buckets.pow2(m), lambda m: pg.Buckets.default(m)], ids=["pow2", "default"])
@pytest.mark.parametrize("max_size", [0, -1, 2.5, True, None])
def test_invalid_max_size(make, max_size):
    with pytest.raises(pg.ContractValueError, match=f"max_size must be an int >= 1, got {max_size!r}"):
        make(max_size)


def test_pow2():
    assert list(pg.Buckets.pow2(1)) == [1]
    assert list(pg.Buckets.pow2(64)) == [1, 2, 4, 8, 16, 32, 64]
    assert list(pg.Buckets.pow2(100)) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        pg.Buckets.pow2(0)
    assert list(pg.Buckets.pow2(5)) == [1, 2, 4]


def test_default_ladder_is_sglang_like():
    d = list(pg.Buckets.default())
    assert d[:10] == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48] and d[-1] == 256
    assert all(b - a == 8 for a, b in zip(d[6:], d[7:]))
    big = list(pg.Buckets.default(512))
    assert big[:len(d)] == d and big[len(d):] == list(range(272, 513, 16))
    assert list(pg.Buckets.default(20)) == [1, 2, 4, 8, 12, 16, 20]
    assert list(pg.Buckets.default(1)) == [1]
    assert list(pg.Buckets.default(300))[-2:] == [288, 300]
