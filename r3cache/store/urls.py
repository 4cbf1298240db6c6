"""Store URLs as people see them: on screens, in reports, reprs and errors."""

from __future__ import annotations


def display_url(url: str) -> str:
    """``url`` as a screen or a report shows it: without its user info and the query
    options that name a password (``password``, ``ssl_password``), which hold secrets;
    the rest as given."""
    head, _, query = url.partition("?")
    scheme, slashes, rest = head.partition("://")
    if slashes:
        netloc, slash, path = rest.partition("/")
        head = f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"
    kept = [o for o in query.split("&") if o and "password" not in o.partition("=")[0].lower()]
    return head + ("?" + "&".join(kept) if kept else "")
