"""Transport backends, loaded lazily by name (see kv_transfer.transport)."""
