"""How an attempt on the pools fails, and how a pool's error or Ray's exception is read as one.

The kind decides what follows: a lost or stalled replica is retried (or the stream resumed)
elsewhere, a failed prefill or KV hand-off computes the prompt on decode next, an unavailable
replica is asked again uncounted, and a pool's refusal is answered with a status.
"""

from __future__ import annotations

from common.errors import InvalidRequestError, OverloadedError

UNAVAILABLE = "unavailable: "  # the kind a pool's error delta starts with (decode_pool.server)


class ReplicaLost(Exception):
    """A pool replica died or vanished during an attempt (retryable before any token was sent)."""


class AttemptFailed(Exception):
    """The attempt failed for a reason another replica may not have (e.g. the KV hand-off)."""


class ReplicaUnavailable(Exception):
    """The replica refused the attempt before any work: its engine stopped (another one can serve)."""


class PrefillFailed(AttemptFailed):
    """The prefill side failed the attempt (replica lost, engine stopped, hand-off failed): the
    next attempt computes the prompt on its decode replica."""


class KVLoadFailed(PrefillFailed):
    """The attempt's KV hand-off failed (a chunk refused, a lease run out, a transport error): the
    next attempt computes the prompt on decode, or none follows (kv_load_failure_policy "fail")."""


def is_replica_loss(exc: BaseException) -> bool:
    try:
        from ray import exceptions as ray_exceptions
    except ImportError:  # pragma: no cover - Ray is always installed with the router
        return False
    lost = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError, ray_exceptions.WorkerCrashedError)
    return isinstance(exc, lost) and not isinstance(exc, ray_exceptions.RayTaskError)


def is_backpressure(exc: BaseException) -> bool:
    try:
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, BackPressureError)


def raise_for_pool_error(error: str) -> None:
    """Pools report request-level refusals as 'kind: message' strings; turn them back into errors."""
    kind, _, message = error.partition(": ")
    if kind == "invalid_request":
        raise InvalidRequestError(message)
    if kind == "overloaded":
        raise OverloadedError(message)
