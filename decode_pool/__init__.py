"""The decode pool: reservations, KV receiver, continuous decode batching, token streams.

``server.py`` is the Serve deployment (reserve, issue the ticket, stream); ``prefill_site.py``
decides where a prompt runs. What the engine does when KV lands or a transfer fails is
``engine/handoff/decode.py``.
"""
