"""Store URLs: split with one typed error, and shown without their secrets."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

from r3cache.errors import ContractError


def url_parts(url: str) -> SplitResult:
    """``url``'s parts, or a ContractError: urlsplit raises a bare ValueError for a host in
    brackets that is no IPv6 address (``redis://[::1:6379``). Its message is not passed
    on: it quotes what stood in the brackets, which may be a password's."""
    try:
        return urlsplit(url)
    except ValueError:
        raise ContractError("the store URL cannot be parsed: a host in brackets must be an "
                            "IPv6 address, and a '[' or ']' in a password percent-encoded "
                            "(%5B, %5D)") from None


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
