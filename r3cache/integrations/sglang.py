"""SGLang plugin: every finished request's routed experts published to r3cache's store.

Registered as the ``sglang.srt.plugins`` entry point ``r3cache``, which SGLang loads in its
main process, its scheduler processes and its detokenizer. It does nothing unless
``R3CACHE_URL`` is set; then the server must run with ``--enable-return-routed-experts``,
and:

- a mistake in an ``R3CACHE_*`` variable, or a ``memory://`` URL (the store would live
  inside the scheduler, out of every trainer's reach), stops each scheduler as it loads
  the plugin, before it loads the model;
- each scheduler that hands out its batches' results (attention-TP rank 0; not with
  pipeline parallelism or prefill-decode disaggregation, which it refuses) opens the store
  ``R3CACHE_URL`` names, under ``R3CACHE_NAMESPACE`` (default: the served model name and
  its weights revision), when it starts: a store it cannot reach, or a namespace of
  another layout, stops the server from starting;
- when a request that asked for its routes (``return_routed_experts``) finishes, the rows
  SGLang gathered for it (``req.routed_experts``: positions ``routed_experts_start_len ..
  seqlen - 2``) are published by a ``RequestPublisher``: full blocks keyed by r3cache's
  hashes of the request's token ids (so a prompt that a GRPO group or another replica
  shares is stored once), the partial ends inline, the manifest under the request's id
  (``meta_info["id"]``);
- ``R3CACHE_INLINE=0`` leaves ``routed_experts`` out of the response (keys only: the
  trainer reads the routes from the store by id).

Writes run in a helper process (Redis) and wait at most ``store_wait`` seconds for room;
a store that stays unavailable longer stops the scheduler rather than answering requests
whose routes were never stored. Options ride on R3CACHE_URL's query next to the store's:
``store_wait``, ``writer``, ``block_size`` (default 16), ``hash_algo`` (default sha256).
With ``R3CACHE_METRICS_PORT`` the scheduler serves the publisher's Prometheus metrics
(DP rank ``i`` on the port plus ``i``).
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

import numpy as np

from r3cache.connector.publisher import RequestPublisher
from r3cache.errors import ContractError, IntegrationError, R3Error
from r3cache.integrations import engine
from r3cache.layout import RoutingLayout
from r3cache.store import open_store

log = logging.getLogger("r3cache.sglang")

_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor." \
             "SchedulerBatchResultProcessor"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
# What the plugin hooks: an SGLang without these hands routes out elsewhere, and the
# plugin stops the scheduler rather than guess.
_TARGETS = (f"{_PROCESSOR}._maybe_collect_routed_experts",
            f"{_SCHEDULER}.init_batch_result_processor")
_OPTIONS = {"store_wait": engine.store_wait, "writer": engine.writer, "block_size": int,
            "hash_algo": str}


class _Plugin:
    """Own this process's publisher (a publishing scheduler's only) and response mode."""

    publisher: RequestPublisher | None = None
    inline: bool = True


_STATE = _Plugin()


def register() -> None:
    """The entry point: hook SGLang's scheduler when R3CACHE_URL is set."""
    if not os.environ.get("R3CACHE_URL"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    problem = _startup_problem()
    if problem is not None:
        # SGLang logs a plugin's exception and serves on; a scheduler that cannot start
        # (before it loads the model) is what tells the user their routes would not be
        # stored.
        def refuse(*args, **kwargs):
            raise problem

        HookRegistry.register(f"{_SCHEDULER}.__init__", refuse, HookType.BEFORE)
        raise problem
    HookRegistry.register(_TARGETS[1], _open_publisher, HookType.AFTER)
    HookRegistry.register(_TARGETS[0], _publish, HookType.AFTER)


def _startup_problem() -> R3Error | None:
    """Why this SGLang cannot store routes as the R3CACHE_* variables ask, or None: an
    API the plugin does not know, a mistake in the variables, or an embedded store."""
    missing = [target for target in _TARGETS if not _resolves(target)]
    if missing:
        return _differs(f"missing {', '.join(missing)}")
    try:
        engine.check_environment(lambda url: engine.split_url(url, _OPTIONS))
    except R3Error as exc:
        return exc
    if engine.embedded(os.environ["R3CACHE_URL"]):
        return IntegrationError("R3CACHE_URL is memory://, a store inside each scheduler: no "
                                "trainer could read the routes published there, and their "
                                "manifests would hold them until it is full; use a Redis URL")
    return None


def _resolves(target: str) -> bool:
    import pkgutil

    owner, _, attr = target.rpartition(".")
    try:
        return hasattr(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError, ValueError):
        return False


def _differs(what: str) -> IntegrationError:
    try:
        from sglang.version import __version__ as version
    except ImportError:
        version = "(unknown)"
    return IntegrationError(
        f"R3CACHE_URL is set, but SGLang {version} does not hand out routed experts where "
        f"r3cache's plugin hooks them (SGLang 0.5.23): {what}. Unset R3CACHE_URL or install "
        "an SGLang the plugin supports.")


# -- scheduler start ----------------------------------------------------------------


def _open_publisher(result: Any, scheduler: Any) -> None:
    """After the scheduler built its result processor: open the store, once a process."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    parallel = get_parallel()
    if parallel.attn_tp_rank != 0 or _STATE.publisher is not None:
        return  # another rank of this group hands out the same requests' results
    if getattr(parallel, "pp_size", 1) > 1:
        raise IntegrationError("r3cache's SGLang plugin publishes from one scheduler per "
                               "request; pipeline parallelism (--pp-size > 1) splits the "
                               "layers' routes across schedulers")
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
    if mode != "null":
        raise IntegrationError(f"r3cache's SGLang plugin publishes a request from the one "
                               f"scheduler that finishes it; this is a {mode} server of a "
                               "prefill-decode disaggregation, where the prompt's routes and "
                               "the response's are gathered by two servers")
    capturer = get_global_experts_capturer()
    if capturer is None:
        raise IntegrationError("R3CACHE_URL is set, but SGLang runs without "
                               "--enable-return-routed-experts: there are no routes to store")
    url, options = engine.split_url(os.environ["R3CACHE_URL"], _OPTIONS)
    inline = engine.inline()
    config = scheduler.model_config
    layout = RoutingLayout(capturer.num_layers, capturer.topk_size,
                           _num_experts(config.hf_text_config), options.pop("block_size", 16))
    args = scheduler.server_args
    namespace = os.environ.get("R3CACHE_NAMESPACE") or engine.default_namespace(
        args.served_model_name, args.model_path, args.revision)
    rank = getattr(parallel, "dp_rank", None) or getattr(parallel, "attn_dp_rank", 0) or 0
    store = open_store(url, layout=layout, namespace=namespace,
                       hash_algo=options.pop("hash_algo", "sha256"),
                       **engine.rank_owner(url, rank, getattr(args, "dp_size", 1) or 1))
    try:
        _STATE.publisher = RequestPublisher(layout=layout, store=store, **options)
    except BaseException:
        store.close()
        raise
    atexit.register(_close)  # a scheduler that exits normally writes what is pending
    _STATE.inline = inline
    server = engine.serve_metrics(rank)
    if server is not None:
        log.info("r3cache: metrics on port %s (/metrics)", server.server_port)
    log.info("r3cache: routed experts of %s go to %r (namespace %r, layout %s)",
             args.model_path, store, namespace, layout.fingerprint)


def _close() -> None:
    publisher, _STATE.publisher = _STATE.publisher, None
    if publisher is None:
        return
    try:
        publisher.close()
    except R3Error as exc:
        log.error("r3cache: routes still pending when the scheduler exited were not "
                  "stored: %s", exc)


def _num_experts(config: Any) -> int:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise IntegrationError(f"cannot tell the number of routed experts of "
                           f"{type(config).__name__} (no num_experts, n_routed_experts or "
                           "num_local_experts)")


# -- request finished ---------------------------------------------------------------


def _publish(result: Any, processor: Any, req: Any) -> None:
    """After SGLang gathered a finished request's routes: publish them, then (keys only)
    take them out of its response."""
    publisher = _STATE.publisher
    rows = getattr(req, "routed_experts", None)
    if publisher is None or rows is None:
        return  # not the publishing rank, or a request that did not ask for routes
    tokens = np.concatenate([np.asarray(req.origin_input_ids, dtype=np.int64),
                             np.asarray(req.output_ids_through_stop, dtype=np.int64)])
    start = min(int(req.routed_experts_start_len or 0), max(len(tokens) - 1, 0))
    lora = getattr(req, "lora_id", None)
    try:
        publisher.publish(req.rid, tokens, rows.numpy(), start,
                          extra_keys=(lora,) if lora else None)
    except ContractError as exc:
        # Rows SGLang itself got wrong (it warns of row-count mismatches and serves on), or
        # a caller's rid that cannot name a manifest (over 1024 characters, a lone
        # surrogate): nothing is stored for this request, and its response keeps its rows.
        publisher.stats.errors[type(exc).__name__] += 1
        log.error("r3cache: routes of request %r not stored: %s", req.rid, exc)
        return
    if not _STATE.inline:
        req.routed_experts = None
