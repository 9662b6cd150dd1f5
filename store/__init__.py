"""The SQLite store: schema and migrations, the batched writer, the views and the queries."""

from store.db import APPLICATION_ID, SCHEMA_VERSION, Store, open_store
from store.errors import StoreError, UserError

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "Store", "StoreError", "UserError", "open_store"]
