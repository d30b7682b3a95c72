"""Append-only, compressed column tables (see ``Store``)."""

from probing.node.store.codec import CODECS, DEFAULT_CODEC, Codec, get_codec
from probing.node.store.store import Store
from probing.node.store.table import EventTable, TableStats

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "Codec",
    "EventTable",
    "Store",
    "TableStats",
    "get_codec",
]
