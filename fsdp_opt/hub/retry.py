"""Talking to the Hub through its faults: which errors are worth another try (a reset connection, a timeout, a 5xx,
a 429 after its Retry-After, a push's 409 or 412) and which end the trying (any other 4xx), the retry loop with its
waits, the one-line form of an error (never a URL's query or a header: never the token), and the timeouts of
huggingface_hub's client (it has none)."""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any

MAX_BACKOFF = 60.0
MAX_RETRY_AFTER = 600.0  # the longest a Retry-After header is waited for
# Every Hub call's client: a connection within CONNECT_S, and no read or write of a request waiting longer than IO_S
# for the other side (huggingface_hub's own client waits forever: a Hub that stops answering would hang the push).
CONNECT_S, IO_S = 30.0, 300.0


def status_code(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def is_transient(exc: BaseException, conflicts: bool = False) -> bool:
    """Worth another try: a network error (a reset connection), a timeout, a 5xx, a 429 or a 408; with `conflicts`
    (a commit that names no parent: a push), a 409 or 412, another commit having landed at the same time. Not: any
    other 4xx (401, 403, a 404 of the repo, a quota refused), a missing local file."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError, ValueError, TypeError)):
        return False
    code = status_code(exc)
    if code is not None:
        return code >= 500 or code in (408, 429) or (conflicts and code in (409, 412))
    # httpx's network errors (huggingface_hub's client: ConnectError, ReadError, ...) derive from its TransportError,
    # not from OSError.
    transport = any(c.__name__ == "TransportError" and c.__module__.startswith("httpx") for c in type(exc).__mro__)
    return transport or isinstance(exc, (OSError, TimeoutError, ConnectionError)) or "Timeout" in type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line about a Hub error, without URLs' query strings or headers (never the token)."""
    code = status_code(exc)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"HTTP {code}: {first}" if code else f"{type(exc).__name__}: {first}"


def retry_after(exc: BaseException) -> float | None:
    """The seconds a response's Retry-After asks for (a number, or an HTTP date), at most MAX_RETRY_AFTER."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(MAX_RETRY_AFTER, max(0.0, seconds))


def with_retries(
    fn: Callable[[], Any],
    retries: int,
    backoff: float,
    on_retry: Callable[[int, float, BaseException], None] | None = None,
    conflicts: bool = False,
) -> Any:
    """Run fn; on a transient error wait what the response's Retry-After says, else backoff, 2*backoff, 4*backoff ...
    (at most 60 s), and try again; a permanent error ends the retrying at once."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified just below
            if attempt == retries or not is_transient(exc, conflicts):
                raise
            asked = retry_after(exc)
            delay = asked if asked is not None else min(MAX_BACKOFF, backoff * 2**attempt)
            if on_retry is not None:
                on_retry(attempt + 1, delay, exc)
            time.sleep(delay)
    raise AssertionError("unreachable")


def set_timeouts(connect: float, io: float) -> None:
    """Timeouts on huggingface_hub's shared HTTP client (it has none: a request the Hub never answers would wait
    forever), so a hung call fails, and is retried, as any network error is."""
    from huggingface_hub.utils import get_session

    client = get_session()
    client.timeout = type(client.timeout)(io, connect=connect)
