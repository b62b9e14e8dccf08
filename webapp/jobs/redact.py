"""What a job's viewers may read of an internal error.

A job's failure detail and its event log are shown to every member of its project, while the
errors they quote come from the service's own machinery: Ray names the node an actor died on,
a broker or database client names the host and port it could not reach, and a URL may carry
its password. ``redact`` keeps the words that say what went wrong and replaces the addresses:
credentials in URLs, IP addresses (v4 and v6) and the host names the service is configured
with (its database, Redis and Ray addresses, where dotted). The unredacted text stays in the service's log.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import urlsplit

ADDRESS = "<address>"
CREDENTIALS = "<credentials>@"

_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)[^\s/@]*@", re.IGNORECASE)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w.])")
# Eight hex groups, or fewer around a ``::`` (``fe80::1``, ``::1``); a clock time (``12:30:05``)
# or a MAC address has neither, and a C++ name (``c10::Error``) is glued to a word.
_IPV6 = re.compile(
    r"(?<![\w:])(?:"
    r"(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}"
    r"|(?:[0-9a-f]{1,4}:){0,6}[0-9a-f]{0,4}::(?:[0-9a-f]{1,4}:){0,6}[0-9a-f]{0,4}"
    r")(?![\w:])",
    re.IGNORECASE,
)
_HEX = re.compile(r"[0-9a-f]", re.IGNORECASE)


def _host(value: str | None) -> str | None:
    """The host name in a URL or ``host:port`` address, if it is a dotted name: one word
    (``redis`` in a compose file) says nothing about the network, and may be a word of the
    message too."""
    if not value:
        return None
    host = urlsplit(value if "://" in value else f"//{value}").hostname
    if not host or _IPV4.fullmatch(host) or ":" in host or "." not in host:
        return None  # an address (replaced anyway) or a one-word service name ("redis")
    return host


@functools.cache
def _configured_hosts() -> tuple[re.Pattern, ...]:
    from django.conf import settings

    database = settings.DATABASES["default"]
    candidates = {
        _host(str(database.get("HOST") or "")),
        _host(getattr(settings, "CELERY_BROKER_URL", None)),
        _host(getattr(settings, "NEREUS_RAY_ADDRESS", None)),
    }
    for layer in getattr(settings, "CHANNEL_LAYERS", {}).values():
        hosts = layer.get("CONFIG", {}).get("hosts", [])
        candidates.update(_host(host) for host in hosts if isinstance(host, str))
    names = sorted((host for host in candidates if host), key=len, reverse=True)
    return tuple(re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])") for name in names)


def redact(text: str) -> str:
    """``text`` with credentials in URLs, IP addresses and configured host names replaced."""
    if not text:
        return text
    text = _URL_CREDENTIALS.sub(lambda m: m["scheme"] + CREDENTIALS, text)
    text = _IPV4.sub(ADDRESS, text)
    text = _IPV6.sub(lambda m: ADDRESS if _HEX.search(m[0]) else m[0], text)
    for name in _configured_hosts():
        text = name.sub(ADDRESS, text)
    return text


def redact_data(value):
    """``redact`` applied to every string in a JSON-like value (dict keys are left alone)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_data(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_data(item) for item in value)
    return value
