"""The prefill pool: prompts in, KV pushed layer by layer to the decode replica that reserved it.

``server.py`` is the Serve deployment. What the engine does with a ticket (push windows, leases,
pushes cut off, what a push's end releases) is ``engine/handoff/prefill.py``; the wait until a
request's hand-off has ended is ``engine/handoff/watches.py``.
"""
