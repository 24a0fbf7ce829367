"""The decode pool: reservations, KV receiver, continuous decode batching, token streams."""
