"""An object store's endpoint: credentials kept out of endpoint URLs, and name-resolution
failures told apart from transient ones.

* :func:`strip_userinfo` / :func:`strip_endpoint_credentials`: ``user:password@`` out of
  an ``endpoint_url`` (credentials in a URL end up in logs);
* :func:`name_resolution_error`: the DNS failure behind a client library's error, however
  deep it is wrapped; :func:`resolution_retryable` says which are retried, and how long.
"""

from __future__ import annotations

import errno
import socket
import warnings
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# getaddrinfo's answers that mean "this name does not exist": retrying cannot fix them.
NO_SUCH_NAME = frozenset(
    getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL") if hasattr(socket, n)
)
# "Temporary failure in name resolution" (no DNS server reachable, e.g. no network):
# retried, but only this long, so a machine without network fails in seconds.
RESOLVE_DEADLINE = 5.0


def strip_userinfo(url: str) -> tuple[str, list[str]]:
    """``url`` without ``user:password@``, and the removed parts (to redact them).

    Parameters
    ----------
    url : str
        An endpoint URL such as ``http://KEY:SECRET@host:9000``.

    Returns
    -------
    tuple of (str, list of str)
        The URL with its userinfo removed, and the user name and password found.
    """
    try:
        parts = urlsplit(url)
        user, password, host, port = parts.username, parts.password, parts.hostname, parts.port
    except ValueError:
        return url, []
    if user is None and password is None:
        return url, []
    netloc = (f"[{host}]" if host and ":" in host else host or "") + (f":{port}" if port else "")
    return urlunsplit(parts._replace(netloc=netloc)), [s for s in (user, password) if s]


def strip_endpoint_credentials(opts: dict[str, Any], where: str) -> list[str]:
    """Remove ``user:password@`` from ``opts``' ``endpoint_url`` (top level or in
    ``client_kwargs``, copied before it is changed), with a warning; the parts removed.

    Parameters
    ----------
    opts : dict
        Storage options, changed in place.
    where : str
        ``scheme://bucket``, for the warning.
    """
    found: list[str] = []
    ck = opts.get("client_kwargs")
    for holder in (opts, ck if isinstance(ck, dict) else None):
        url = holder.get("endpoint_url") if holder is not None else None
        if holder is None or not isinstance(url, str):
            continue
        clean, parts = strip_userinfo(url)
        if parts:
            if holder is ck:
                holder = opts["client_kwargs"] = dict(ck)
            holder["endpoint_url"] = clean
            found += parts
            warnings.warn(
                f"{where}: endpoint_url {clean} carried user:password@; it was removed "
                "(credentials in a URL end up in logs): pass them as storage options instead",
                UserWarning,
                stacklevel=4,
            )
    return found


def name_resolution_error(e: BaseException) -> socket.gaierror | None:
    """The :class:`socket.gaierror` behind ``e`` (its cause chain, or the ``os_error`` /
    ``error`` attributes aiohttp and botocore wrap it in), or None."""
    seen: set[int] = set()
    todo: list[Any] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen or not isinstance(x, BaseException):
            continue
        seen.add(id(x))
        if isinstance(x, socket.gaierror):
            return x
        kwargs = getattr(x, "kwargs", None)
        todo += [x.__cause__, x.__context__, getattr(x, "os_error", None)]
        if isinstance(kwargs, dict):
            todo.append(kwargs.get("error"))
    return None


def resolution_retryable(dns: socket.gaierror, elapsed: float) -> bool:
    """Whether a request that failed to resolve its host may be tried again ``elapsed``
    seconds after its first attempt: a name that does not exist stays so; "try again"
    (no DNS server reachable) is retried, but only for :data:`RESOLVE_DEADLINE` seconds.

    Parameters
    ----------
    dns : socket.gaierror
        The failure (see :func:`name_resolution_error`).
    elapsed : float
        Seconds since the request's first attempt.
    """
    return dns.errno not in NO_SUCH_NAME and (
        dns.errno == getattr(socket, "EAI_AGAIN", errno.EAGAIN) and elapsed < RESOLVE_DEADLINE
    )
