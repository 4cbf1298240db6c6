"""Store URLs: split with one typed error, and shown without their secrets."""

from __future__ import annotations

from urllib.parse import SplitResult, unquote_plus, urlsplit

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


# Options an engine's R3CACHE_URL carries for its plugin, not for its store: the vLLM
# plugin's connector options and the SGLang plugin's block size (tests/test_reader.py holds
# this set to the plugins' own). They govern an engine's writes and its layout.
ENGINE_OPTIONS = frozenset({"on_unavailable", "store_wait", "writer", "local_tier_bytes",
                            "block_size"})


def without_engine_options(url: str) -> str:
    """``url`` without ENGINE_OPTIONS in its query, the rest as given: what a reader (a
    trainer's ``R3Reader``, the CLI) opens when handed the engine's R3CACHE_URL. It
    writes nothing and reads the stored layout, so they have nothing to govern there."""
    head, mark, query = url.partition("?")
    kept = [o for o in query.split("&")
            if unquote_plus(o.partition("=")[0]) not in ENGINE_OPTIONS]
    return head + (mark + "&".join(kept) if any(kept) else "")
