"""Converting AnnData sources into layout stores (``sclayout convert``)."""

from __future__ import annotations

from sclayout.convert.codecs import CODECS, get_codec
from sclayout.convert.convert import convert
from sclayout.convert.order import ORDERS, get_order
from sclayout.convert.plan import DEFAULT_BLOCK_SIZE, parse_memory_budget

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "ORDERS",
    "convert",
    "get_codec",
    "get_order",
    "parse_memory_budget",
]
