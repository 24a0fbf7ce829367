"""The prefill pool: prompts in, KV pushed layer by layer to the decode replica that reserved it."""
