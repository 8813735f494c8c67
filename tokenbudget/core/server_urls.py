"""An inference server's URL: what it may hold (one http(s) host, nothing secret, since
it is shown in logs, metrics, events and ``status``), how an error shows one, and
whether what is sent to it crosses a network in the clear.
"""

from __future__ import annotations

import ipaddress
import urllib.parse

from tokenbudget.core.errors import ConfigError


def one_server_per_url(url: str) -> str:
    """What to do with several servers in one URL: the one place that says it."""
    return (
        f"{url!r} names several servers, but it takes one URL: give each server its own "
        '[[inference.servers]] table (url = "http://..."), or pass --server URL once per '
        "server to `tokenbudget run`"
    )


def check_url(url: str, key: str, source: str | None = None) -> None:
    """Raise a ConfigError naming ``key`` unless ``url`` is one http(s) URL of a host
    with nothing secret in it: a server's URL is shown in logs, metrics' ``server``
    label, the fleet's events and ``status``, so it takes no user or password and no
    query string or fragment (a key there would be shown too; keys come from the
    environment). The error never shows what such a URL holds."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ConfigError(key, f"{_masked(url)!r} is not a URL: {exc}", source=source) from None
    if "@" in parts.netloc:
        raise ConfigError(
            key,
            f"{_masked(url)!r} holds a user or password, which a URL shown in logs, metrics "
            f"and status would show too: drop it, and name the environment variable holding "
            f"the server's key in api_key_env ({_KEY_FLAG})",
            source=source,
        )
    if "?" in url or "#" in url:
        raise ConfigError(
            key,
            f"{_masked(url)!r} has a query string or fragment, which a URL shown in logs, "
            "metrics and status would show too (a key in it with them): drop it; a server's "
            f"key comes from the environment variable named in api_key_env ({_KEY_FLAG})",
            source=source,
        )
    if "," in url or len(url.split()) > 1:
        raise ConfigError(key, one_server_per_url(url), source=source)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(key, f"{url!r} is not an http(s) URL", source=source)
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise ConfigError(key, f"{url!r}: {exc}", source=source) from None
    if not parts.hostname:
        raise ConfigError(key, f"{url!r} names no host", source=source)


# Where a server added at run time says the same.
_KEY_FLAG = "`servers add --api-key-env` for a server added at run time"


def _masked(url: str) -> str:
    """``url`` as an error may show it: no user or password, no query or fragment."""
    scheme, has_slashes, rest = url.partition("://")
    if not has_slashes:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "…@" + authority.rpartition("@")[2]
    shown = f"{scheme}://" * bool(scheme) + authority + slash + path
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else shown[:cut] + shown[cut] + "…"


def in_clear(url: str) -> bool:
    """Whether what is sent to ``url`` can be read on the way: plain http to a host
    other than this machine's loopback (the end of an SSH tunnel is loopback)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name: whatever it resolves to, the key crosses a network
