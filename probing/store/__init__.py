"""Append-only, compressed column tables (see ``Store``)."""

from probing.store.codec import CODECS, DEFAULT_CODEC, Codec, get_codec
from probing.store.store import Store, default_store
from probing.store.table import EventTable, TableStats

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "Codec",
    "EventTable",
    "Store",
    "TableStats",
    "default_store",
    "get_codec",
]
