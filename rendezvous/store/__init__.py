"""Store backends behind one interface, chosen by URL (see ``base.Store``)."""

from .base import Compare, Delete, Event, KeyValue, Put, Store, StoreError, StoreUnavailable

__all__ = [
    "Compare", "Delete", "Event", "KeyValue", "Put", "Store", "StoreError", "StoreUnavailable",
]
