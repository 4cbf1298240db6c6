"""vLLM plugin: r3cache's worker connector and block store behind vLLM's aux-output connector.

Registered as the ``vllm.general_plugins`` entry point ``r3cache``, which vLLM loads in its
API process, its engine core and every worker. It does nothing unless ``R3CACHE_URL`` is
set; then, with ``--enable-return-routed-experts``:

- the model runner gets r3cache's ``WorkerConnector`` in place of vLLM's, fed by vLLM's
  own capturer (its device buffer, its snapshot, its copy to the host on the output copy
  stream), publishing to the store ``R3CACHE_URL`` names under ``R3CACHE_NAMESPACE``
  (default: the served model name and its weights revision);
- the scheduler's connector also tells the worker when a request finished for good, with
  its final token count, so the worker records a manifest under the id vLLM's caller
  knows (``RequestOutput.request_id``; ``<id>/<i>`` for the i-th sample of ``n > 1``);
- ``R3CACHE_INLINE=0`` leaves ``routed_experts`` out of responses (keys only: the trainer
  reads the routes from the store by request id);
- ``memory://`` keeps the blocks inside the engine, sized as vLLM sizes its own store (a
  block of routes per KV-cache block, plus those of the steps in flight, unless the URL or
  ``--aux-output-config`` gives ``max_bytes``), and records no manifests: nothing outside
  the engine could read them;
- the connector's Prometheus metrics (``r3cache.metrics``) appear on vLLM's own /metrics
  (the engine core exports them to a directory the API server reads), and with
  ``R3CACHE_METRICS_PORT`` also on a port of the engine core's own.

Options of the worker connector ride on the URL's query next to the store's
(``on_unavailable``, ``store_wait``, ``writer``, ``local_tier_bytes``). Anything the plugin
cannot do as asked (a mistake in an ``R3CACHE_*`` variable, found as the plugin loads; an
engine without ``--enable-return-routed-experts``; a vLLM whose connector API differs; a
store it cannot reach; a namespace of another layout) raises at engine start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from r3cache.connector.metadata import PackedHashes, StepBatch, StepMetadata
from r3cache.connector.worker import WorkerConnector
from r3cache.errors import ContractError, IntegrationError
from r3cache.integrations import engine
from r3cache.layout import RoutingLayout
from r3cache.manifest import Completion, check_request_id
from r3cache.store import open_store
from r3cache.store.writers import check_choice

log = logging.getLogger("r3cache.vllm")

# What the plugin rebinds or calls, module by module: a vLLM without any of these has
# another connector API, and the plugin refuses to start rather than guess.
_API = {
    "vllm.v1.worker.gpu.model_runner": ("get_aux_output_connector",),
    "vllm.v1.core.sched.scheduler": ("AuxOutputSchedulerConnector",),
    "vllm.distributed.aux_output_connector.connector": (
        "AuxOutputSchedulerConnector", "AuxOutputConnectorMetadata"),
    "vllm.model_executor.layers.fused_moe.routed_experts_capturer": (
        "RoutedExpertsCapturer", "bind_routed_experts_capturer"),
    "vllm.v1.core.kv_cache_utils": ("resolve_kv_cache_block_sizes",),
    "vllm.distributed.parallel_state": ("get_tp_group",),
    "vllm.v1.request": ("Request",),
    "vllm.v1.engine.core_client": ("InprocClient",),
    "vllm.engine.arg_utils": ("EngineArgs",),
}
_SCHEDULER_METHODS = ("build_connector_meta", "request_finished", "take_output", "reset")
# WorkerConnector options that may ride on R3CACHE_URL's query.
_CONNECTOR_OPTIONS = {"on_unavailable": engine.on_unavailable, "store_wait": engine.store_wait,
                      "writer": engine.writer, "local_tier_bytes": engine.local_tier_bytes}


def register() -> None:
    """The entry point: rebind vLLM's connector factories when R3CACHE_URL is set."""
    if not os.environ.get("R3CACHE_URL"):
        return
    # vLLM loads this in its API process as it starts: a mistake in the variables stops
    # it there, not in the engine core once the model is loaded.
    engine.check_environment(split_url)
    import importlib

    modules = {name: _import(importlib, name) for name in _API}
    missing = [f"{name}.{attr}" for name, attrs in _API.items() for attr in attrs
               if not hasattr(modules[name], attr)]
    base = getattr(modules["vllm.distributed.aux_output_connector.connector"],
                   "AuxOutputSchedulerConnector", None)
    missing += [f"AuxOutputSchedulerConnector.{m}" for m in _SCHEDULER_METHODS
                if base is not None and not hasattr(base, m)]
    if base is not None:
        missing += [f"AuxOutputSchedulerConnector.{a}"
                    for a in ("_sent_hash_counts", "_finished_requests") if not hasattr(base(), a)]
    if missing:
        _differs(f"missing {', '.join(missing)}")
    modules["vllm.v1.worker.gpu.model_runner"].get_aux_output_connector = worker_connector
    modules["vllm.v1.core.sched.scheduler"].AuxOutputSchedulerConnector = \
        _scheduler_connector_class(base)
    _require_routed_experts(modules["vllm.engine.arg_utils"].EngineArgs)
    _keep_external_ids(modules["vllm.v1.request"].Request)
    _drain_terminal_events(modules["vllm.v1.engine.core_client"].InprocClient)
    _bridge_metrics()


# The directory where engine-core processes leave the connector's metrics for the API
# server's /metrics; set by the first process that loads the plugin, inherited by the
# processes it starts.
_METRICS_DIR = "_R3CACHE_METRICS_DIR"


def _bridge_metrics() -> None:
    """In the first vLLM process (the API server): serve the metrics that the processes
    it starts export, on vLLM's own /metrics (prometheus_client's default registry)."""
    if os.environ.get(_METRICS_DIR):
        return
    try:
        import prometheus_client
    except ImportError:  # vLLM ships it; without it there is no /metrics to feed
        return
    import atexit
    import shutil
    import tempfile

    from r3cache import metrics

    directory = tempfile.mkdtemp(prefix="r3cache-metrics-")
    os.environ[_METRICS_DIR] = directory
    atexit.register(shutil.rmtree, directory, True)
    prometheus_client.REGISTRY.register(metrics.file_bridge(directory))


def _import(importlib, name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        _differs(f"cannot import {name} ({exc})")


def _differs(what: str):
    try:
        from vllm import __version__ as version
    except ImportError:
        version = "(not installed)"
    raise IntegrationError(
        f"R3CACHE_URL is set, but vLLM {version} does not have the aux-output connector API "
        f"r3cache's plugin knows (vLLM 0.32-0.33): {what}. Unset R3CACHE_URL or install a "
        "vLLM the plugin supports."
    )


# -- request ids --------------------------------------------------------------------


def manifest_id(internal_id: str, external_id: str | None) -> str:
    """The id a request's manifest is recorded under: the one vLLM's caller knows.

    vLLM's engine core knows ``<caller's id>-<8 random hex>`` (or the caller's id when
    randomisation is off); the i-th sample of an ``n > 1`` request is ``<i>_<parent's
    internal id>`` and shares its parent's caller id, so it is recorded as ``<id>/<i>``.
    """
    if external_id is None:
        return internal_id
    child = re.fullmatch(r"(\d+)_(.+)", internal_id)
    if child and child.group(2).startswith(external_id) and internal_id != external_id:
        return f"{external_id}/{child.group(1)}"
    return external_id


def _require_routed_experts(engine_args_class) -> None:
    """An engine configured without ``--enable-return-routed-experts`` builds no connector:
    with R3CACHE_URL set it would record nothing, and its trainer would wait for manifests
    that never come. Its configuration is refused where it is made (``vllm serve``'s API
    process, ``LLM``), before any engine process starts or loads the model."""
    original = engine_args_class.create_engine_config
    if getattr(original, "_r3cache", False):
        return

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if not config.aux_output_config.enabled:
            raise IntegrationError("R3CACHE_URL is set, but vLLM runs without "
                                   "--enable-return-routed-experts: there are no routes to "
                                   "store. Pass the flag, or unset R3CACHE_URL.")
        return config

    create_engine_config._r3cache = True
    engine_args_class.create_engine_config = create_engine_config


def _keep_external_ids(request_class) -> None:
    """Requests built in the engine core remember the id their caller knows."""
    original = request_class.from_engine_core_request.__func__
    if getattr(original, "_r3cache", False):
        return

    def from_engine_core_request(cls, request, *args, **kwargs):
        made = original(cls, request, *args, **kwargs)
        made.r3cache_id = manifest_id(request.request_id,
                                      getattr(request, "external_req_id", None))
        return made

    from_engine_core_request._r3cache = True
    request_class.from_engine_core_request = classmethod(from_engine_core_request)


def _drain_terminal_events(client_class) -> None:
    """An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) steps once more after its
    last output, as an engine-core process does by itself: the scheduler tells the
    worker which requests finished in the step after they did, and that step is what
    records their manifests."""
    original = client_class.dp_engines_running
    if getattr(original, "_r3cache", False):
        return

    def dp_engines_running(self) -> bool:
        core = getattr(self, "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        return original(self) or bool(scheduler is not None
                                       and scheduler.has_finished_requests())

    dp_engines_running._r3cache = True
    client_class.dp_engines_running = dp_engines_running


# -- scheduler side -----------------------------------------------------------------


_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    # Built on first use, so importing this module never imports vLLM; found by name
    # here, so the metadata pickles between vLLM's engine core and its workers.
    if name == "R3ConnectorMetadata":
        return _metadata_class()
    raise AttributeError(name)


def _metadata_class() -> type:
    if "metadata" not in _built:
        from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

        @dataclass
        class R3ConnectorMetadata(AuxOutputConnectorMetadata):
            """vLLM's step metadata, the requests that finished for good this step, the
            ids their manifests are recorded under, and the finished ones that were
            preempted (they resume)."""

            completions: dict[str, Completion] = field(default_factory=dict)
            record_as: dict[str, str] = field(default_factory=dict)
            preempted: tuple[str, ...] = ()

        R3ConnectorMetadata.__qualname__ = "R3ConnectorMetadata"
        _built["metadata"] = R3ConnectorMetadata
    return _built["metadata"]


def _scheduler_connector_class(base):
    metadata_class = _metadata_class()

    class R3SchedulerConnector(base):
        """Own vLLM's scheduler-side connector state plus the completions for manifests
        and the preempted requests the worker keeps what they were given for."""

        def __init__(self) -> None:
            super().__init__()
            self._completions: dict[str, Completion] = {}
            self._record_as: dict[str, str] = {}
            self._preempted: list[str] = []  # for the next metadata
            # Preempted and not scheduled since: the worker keeps what they were given
            # until it hears that they ended.
            self._waiting: set[str] = set()
            self._inline = engine.inline()

        def build_connector_meta(self, scheduler_output, requests):
            meta = super().build_connector_meta(scheduler_output, requests)
            completions, self._completions = self._completions, {}
            record_as, self._record_as = self._record_as, {}
            preempted, self._preempted = tuple(self._preempted), []
            if self._waiting:
                self._waiting.difference_update(meta.requests)
            return metadata_class(meta.generation, meta.requests, meta.block_hashes,
                                  meta.finished_requests, completions, record_as, preempted)

        def request_finished(self, request) -> None:
            # Only a request the worker heard of gets a terminal event (and a manifest);
            # a preempted one is finished on the worker but not for good.
            req_id = request.request_id
            known, waiting = req_id in self._sent_hash_counts, req_id in self._waiting
            super().request_finished(request)
            if not request.is_finished():
                if known:
                    self._preempted.append(req_id)
                    self._waiting.add(req_id)
                return
            if waiting:
                self._waiting.discard(req_id)
                if req_id in self._preempted:  # not sent yet: the worker hears of its end
                    self._preempted.remove(req_id)
                else:  # ended before it ran again, which vLLM's connector sends no event for
                    self._finished_requests.setdefault(req_id, None)
            if known or waiting:
                params = request.sampling_params
                start = min(getattr(params, "routed_experts_prompt_start", 0) or 0,
                            request.num_prompt_tokens)
                self._completions[req_id] = Completion(start, request.num_tokens)
                self._record_as[req_id] = getattr(request, "r3cache_id", None) or req_id

        def reset(self) -> None:
            # vLLM's connector drops the terminal events the worker has not had: they go
            # to it with the reset, as the generation before's (manifests, and what a
            # preempted request was given), the blocks of their last hashes as rows.
            pending = list(self._finished_requests)
            super().reset()
            self._finished_requests.update(dict.fromkeys(pending))

        def take_output(self, request, output):
            rows = super().take_output(request, output)
            return rows if self._inline else None

    return R3SchedulerConnector


# -- worker side --------------------------------------------------------------------


class _VllmCapture:
    """Own the adapter that lets r3cache's connector snapshot vLLM's capturer."""

    def __init__(self, capturer, layout: RoutingLayout, max_num_batched_tokens: int) -> None:
        self._capturer = capturer
        self.layout = layout
        self.max_num_batched_tokens = max_num_batched_tokens

    def snapshot(self, num_rows: int):
        return self._capturer.snapshot_routing_data(num_rows)

    def host_ring(self, depth: int) -> _VllmCapture:
        return self

    def copy(self, snapshot) -> _HostCopy:
        # vLLM calls enqueue_cpu_copy on its output copy stream and waits on that
        # stream's event before process_output: its own D2H path, unchanged.
        return _HostCopy(snapshot.to("cpu", non_blocking=True))


class _HostCopy:
    """Own one step's rows on the host, a fresh tensor no later step writes."""

    def __init__(self, tensor) -> None:
        self._tensor = tensor

    def result(self):
        return self._tensor.numpy()


def _names_a_request(req_id: str) -> bool:
    try:
        check_request_id(req_id)
    except ContractError:
        return False
    return True


class _Renamed:
    """Own one step's pending output whose requests include stand-ins: vLLM gets its rows
    under its own ids."""

    def __init__(self, pending, originals: dict[str, str]) -> None:
        self._pending = pending
        self._originals = originals

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        self._pending.enqueue_cpu_copy(num_sampled, num_rejected)

    def process_output(self):
        original = self._originals.get
        return {original(r, r): out for r, out in self._pending.process_output().items()}


class VllmWorkerConnector:
    """Own r3cache's WorkerConnector as vLLM's model runner sees its worker connector."""

    def __init__(self, worker: WorkerConnector | None) -> None:
        self.worker = worker
        self._metadata_seen = False
        # vLLM request ids that cannot name a request in r3cache (a caller's X-Request-Id
        # of over 1024 characters, a lone surrogate), each to the stand-in the worker knows
        # it by: vLLM serves any str, and one caller's id must not stop the engine.
        self._stand_ins: dict[str, str] = {}

    def begin_step(self, metadata) -> None:
        self._metadata_seen = metadata is not None
        if self.worker is None or metadata is None:
            return
        step = StepMetadata(
            metadata.generation, metadata.requests,
            {r: PackedHashes(packed.data, packed.item_size)
             for r, packed in metadata.block_hashes.items()},
            metadata.finished_requests, getattr(metadata, "completions", {}),
            getattr(metadata, "record_as", {}), getattr(metadata, "preempted", ()))
        try:
            self.worker.begin_step(self._renamed(step) if self._stand_ins else step)
        except ContractError:
            # The worker checks every id before anything changes: the step is taken again
            # once the ids it refused have stand-ins, without the manifests no id names.
            if not (self._add_stand_ins(step) or any(
                    not _names_a_request(step.record_as.get(r, r)) for r in step.completions)):
                raise
            self.worker.begin_step(self._renamed(step))
        for req_id in metadata.finished_requests if self._stand_ins else ():
            self._stand_ins.pop(req_id, None)  # a resumed request gets it again

    def _add_stand_ins(self, step: StepMetadata) -> bool:
        """Give a stand-in to each id of ``step`` that cannot name a request; whether any
        needed one."""
        ids = {*step.requests, *step.block_hashes, *step.finished_requests}
        added = {r: "r3cache-stand-in-" + hashlib.sha256(
                 r.encode("utf-8", "surrogatepass")).hexdigest()
                 for r in ids if isinstance(r, str) and not _names_a_request(r)}
        self._stand_ins.update(added)
        for req_id in added:
            log.warning("r3cache: vLLM request id %.80r cannot name a request in r3cache "
                        "(1-1024 characters UTF-8 can encode); its routes are served "
                        "inline, and no trainer can read them by that id", req_id)
        return bool(added)

    def _renamed(self, step: StepMetadata) -> StepMetadata:
        """``step`` with stand-ins for the ids that have one, and without the completions
        whose manifest no id could name: a stand-in is no name a trainer knows."""
        new = self._stand_ins.get
        completions, record_as = {}, {}
        for req_id, completion in step.completions.items():
            name = step.record_as.get(req_id, req_id)
            if _names_a_request(name):
                completions[new(req_id, req_id)] = completion
                record_as[new(req_id, req_id)] = name
        return StepMetadata(
            step.generation, {new(r, r): e for r, e in step.requests.items()},
            {new(r, r): h for r, h in step.block_hashes.items()},
            tuple(new(r, r) for r in step.finished_requests), completions, record_as,
            tuple(new(r, r) for r in step.preempted))

    def prepare_output(self, input_batch):
        if self.worker is None or not self._metadata_seen:
            return None  # a dummy or profiling run
        n = len(input_batch.req_ids)  # the worker copies what it keeps
        req_ids = input_batch.req_ids
        originals = {}
        if self._stand_ins:
            req_ids = [self._stand_ins.get(r, r) for r in req_ids]
            originals = {s: r for r, s in self._stand_ins.items()}
        pending = self.worker.prepare_output(StepBatch(
            req_ids, input_batch.num_computed_tokens_np[:n],
            input_batch.query_start_loc_np[: n + 1]))
        return _Renamed(pending, originals) if originals else pending

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def worker_connector(model, vllm_config, kv_cache_config) -> VllmWorkerConnector:
    """What vLLM's model runner builds in place of its AuxOutputWorkerConnector."""
    from vllm.distributed.parallel_state import get_tp_group
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    capturer = RoutedExpertsCapturer(max_num_batched_tokens=max_tokens, vllm_config=vllm_config)
    bind_routed_experts_capturer(model, capturer)
    # Every TP rank captures (collectives); the first one owns the data plane.
    if not get_tp_group().is_first_rank:
        return VllmWorkerConnector(None)
    num_layers, topk = capturer.shape_per_token
    kv_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    layout = RoutingLayout(num_layers, topk, vllm_config.model_config.get_num_experts(),
                           hash_block_size)
    url, connector_options = split_url(os.environ["R3CACHE_URL"])
    namespace = os.environ.get("R3CACHE_NAMESPACE") or default_namespace(
        vllm_config.model_config)
    parallel = vllm_config.parallel_config
    store_options = engine.rank_owner(url, parallel.data_parallel_rank,
                                      parallel.data_parallel_size)
    embedded = engine.embedded(url)
    depth = vllm_config.max_concurrent_batches
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    if embedded and not engine.url_sets(url, "max_bytes"):
        # Sized as vLLM sizes its own store: a block of routes for every block the KV
        # cache holds, so no prefix hit finds its routes evicted; plus the blocks of the
        # steps in flight, which finished requests hold until those steps are processed
        # while the KV cache already reuses their blocks.
        per_step = max_tokens // hash_block_size + max_num_seqs
        store_options["max_bytes"] = vllm_config.aux_output_config.max_bytes or (
            (kv_cache_config.num_blocks * (kv_block_size // hash_block_size)
             + depth * per_step) * layout.block_nbytes)
    store = open_store(url, layout=layout, namespace=namespace,
                       hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
                       **store_options)
    try:
        worker = WorkerConnector(
            layout=layout, store=store,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
            max_concurrent_batches=depth,
            capturer=_VllmCapture(capturer, layout, max_tokens),
            record_manifests=not embedded, **connector_options)
    except BaseException:
        store.close()
        raise
    log.info("r3cache: routed experts of %s go to %r (namespace %r, layout %s)",
             vllm_config.model_config.model, store, namespace, layout.fingerprint)
    if embedded and not engine.inline():
        log.warning("r3cache: R3CACHE_INLINE=0 on memory://: responses carry no routes, and "
                    "no trainer can read a store inside the engine; use a Redis URL")
    _publish_metrics(parallel.data_parallel_rank_local or 0)
    return VllmWorkerConnector(worker)


_METRICS_PUBLISHED: list[Any] = []


def _publish_metrics(rank: int) -> None:
    """Once a process: this connector's metrics for the API server's /metrics (exported
    to the directory it made), and with ``R3CACHE_METRICS_PORT`` on a port of their own
    (vLLM's /metrics is served by its API process, the connector runs in the engine
    core's; ``rank``: the engine core's data-parallel rank on this host)."""
    if _METRICS_PUBLISHED:
        return
    from r3cache import metrics

    directory = os.environ.get(_METRICS_DIR)
    if directory:
        _METRICS_PUBLISHED.append(metrics.export(directory))
    server = engine.serve_metrics(rank)
    if server is not None:
        _METRICS_PUBLISHED.append(server)
        log.info("r3cache: metrics on port %s (/metrics)", server.server_port)


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """R3CACHE_URL as (the store URL, the WorkerConnector options in its query), the
    options checked as the connector will check them with that store."""
    store_url, options = engine.split_url(url, _CONNECTOR_OPTIONS)
    # The WorkerConnector's defaults where the URL gives none.
    check_choice(options.get("writer", "auto"), options.get("on_unavailable", "raise"),
                 engine.embedded(store_url))
    return store_url, options


def default_namespace(model_config) -> str:
    """``<served model name>@<weights revision>`` (``engine.default_namespace``)."""
    served = model_config.served_model_name
    return engine.default_namespace(served[0] if isinstance(served, list) else served,
                                    model_config.model, model_config.revision)
