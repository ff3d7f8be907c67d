"""recommend's verdict on re-converting a store: when a rewrite is advised, and why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loader.layout import RowOrder
from loader.spec import StoreSpec
from sclayout.cost.verdict import REWRITE_GAIN, reconvert_verdict


def _result(cells_per_s: float, diversity: float, *, meets_target: bool = True):
    spec = SimpleNamespace(store=StoreSpec(block_size=32, order=RowOrder("shuffled", 0)))
    pick = SimpleNamespace(
        cells_per_s=cells_per_s,
        diversity=diversity,
        spec=spec,
        row=lambda: {"cells_per_s": cells_per_s, "diversity": diversity},
    )
    return SimpleNamespace(pick=pick, extra={"meets_target": meets_target})


@pytest.mark.parametrize(
    ("gain", "pays"), [(REWRITE_GAIN, True), (REWRITE_GAIN * 1.5, True), (1.0, False), (0.5, False)]
)
def test_a_rewrite_pays_from_the_asked_gain_on(gain, pays):
    out = reconvert_verdict(_result(1000, 0.99), _result(1000 * gain, 0.99), min_diversity=0.95)
    assert out["gain"] == pytest.approx(gain)
    assert out["meets_target"] is True
    assert out["pick"] == {"cells_per_s": 1000 * gain, "diversity": 0.99}
    if pays:
        assert out["verdict"].startswith(f"re-converting would pay: {gain:.2f}x faster")
        assert "block 32, order shuffled, codec blosc-lz4" in out["verdict"]
    else:
        assert out["verdict"] == (
            f"re-converting would not pay ({gain:.2f}x predicted, under the "
            f"{REWRITE_GAIN:.2f}x asked of a rewrite)"
        )


def test_a_store_below_the_target_is_told_the_conversion_that_reaches_it():
    """Even when the rewrite is slower: diversity comes first."""
    now = _result(5000, 0.62, meets_target=False)
    out = reconvert_verdict(now, _result(2000, 0.97), min_diversity=0.95)
    assert out["meets_target"] is False
    assert out["verdict"].startswith(
        "this store cannot reach diversity 0.95 (best 0.620); re-converting with block 32, "
        "order shuffled, codec blosc-lz4 reaches 0.970 at 2,000 cells/s predicted"
    )
    assert out["verdict"].endswith("sclayout convert SRC DST --spec spec.json")
