"""A small continuous-batching engine that drives the connectors the way vLLM does.

It owns a KV prefix cache (hash chain over token IDs, a bounded block pool with LRU
reuse), chunked prefill under a token budget, speculative decoding with random
rejections, async scheduling (up to ``async_depth`` steps in flight), preemption
under KV pressure, prefix-cache resets, and an oracle: a deterministic,
prefix-dependent routing function standing in for the model. After a run it checks
that every finished request received exactly the oracle's rows for
``[prompt_start, num_tokens - 1)`` and that neither worker state nor pins remain.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from r3cache import checks
from r3cache.connector.metadata import RequestOutput, StepBatch
from r3cache.connector.scheduler import SchedulerConnector
from r3cache.connector.worker import WorkerConnector
from r3cache.errors import ContractError, R3Error
from r3cache.hashing import block_hashes
from r3cache.layout import RoutingLayout
from r3cache.store.base import StoreStats

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BASE = 0x100000001B3  # odd, so invertible modulo 2**64


class SimError(R3Error):
    """The simulated engine cannot make progress with its configuration."""


@dataclass(frozen=True)
class Chunk:
    """One request's part of a step: positions ``[start, start + count)``, ``keep`` accepted."""

    req_id: str
    tokens: list[int]
    start: int
    count: int
    keep: int


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _powers(base: int, n: int) -> np.ndarray:
    factors = np.full(n, base, np.uint64)
    factors[:1] = 1
    return np.cumprod(factors, dtype=np.uint64)


def oracle_rows(token_ids, layout: RoutingLayout, weights: int = 0) -> np.ndarray:
    """Routed experts for every position: row ``p`` depends on exactly ``tokens[:p + 1]``
    and on ``weights``, the version of the model's weights (each RL weight update routes
    the same tokens anew).

    A polynomial prefix hash (vectorised with the modular inverse of its base)
    is mixed per layer into a rotation of a fixed expert permutation, so the
    ``topk`` IDs of a row are distinct and in a definite column order.
    """
    tokens = np.asarray(token_ids, dtype=np.uint64) + np.uint64(1)
    n = len(tokens)
    if n == 0:
        return layout.empty_rows()
    inverse = pow(_BASE, -1, 1 << 64)
    prefix = np.cumsum(tokens * _powers(inverse, n), dtype=np.uint64) * _powers(_BASE, n)
    if weights:
        prefix ^= _mix(np.array([weights], np.uint64))  # an array: wraps without a warning
    layer_salt = _mix(np.arange(1, layout.num_layers + 1, dtype=np.uint64))
    h = _mix(prefix[:, None] ^ layer_salt[None, :])
    rotation = (h % np.uint64(layout.num_experts)).astype(np.int64)
    perms = np.random.default_rng(layout.num_experts).permuted(
        np.tile(np.arange(layout.num_experts), (layout.num_layers, 1)), axis=1
    )
    columns = (rotation[:, :, None] + np.arange(layout.topk)) % layout.num_experts
    return perms[np.arange(layout.num_layers)[None, :, None], columns].astype(layout.dtype)


class OracleRoutes:
    """Own the simulator's stand-in for a model: :func:`oracle_rows`, written into each batch.

    A model runner (``r3cache.models.ModelRoutes``) has the same three methods and a
    ``capturer`` the worker snapshots instead of taking rows from ``run``.
    """

    capturer = None
    exact = True  # any difference from the oracle is a data-plane failure

    def __init__(self, layout: RoutingLayout, rng: np.random.Generator) -> None:
        self.layout = layout
        self.rng = rng
        self.weights = 0  # the weights' version: each update routes the same tokens anew
        self._rows: dict[str, np.ndarray] = {}

    def expected(self, req_id: str, tokens: list[int]) -> np.ndarray:
        rows = self._rows[req_id] = oracle_rows(tokens, self.layout, self.weights)
        return rows

    def new_weights(self) -> None:
        """A weight update (RL): requests expected from now on route by the new weights."""
        self.weights += 1

    def run(self, chunks: list[Chunk], qsl: np.ndarray, padding: int) -> np.ndarray:
        # Rows nobody is owed (rejected drafts, padding) are noise: routes a router could
        # have picked (distinct experts), as the target model computes for draft tokens.
        layout = self.layout
        first = self.rng.integers(0, layout.num_experts,
                                  (int(qsl[-1]) + padding, layout.num_layers, 1))
        rows = ((first + np.arange(layout.topk)) % layout.num_experts).astype(layout.dtype)
        for chunk, row in zip(chunks, qsl[:-1].tolist()):
            real = max(0, min(chunk.keep, len(chunk.tokens) - chunk.start))
            rows[row : row + real] = self._rows[chunk.req_id][chunk.start : chunk.start + real]
        return rows

    def forget(self, req_id: str) -> None:
        self._rows.pop(req_id, None)


@dataclass
class SimRequest:
    """One request of a workload: its prompt, its predetermined output and when it arrives.

    The last output token ends the request (EOS); ``max_tokens`` only bounds
    what the scheduler may schedule optimistically.
    """

    req_id: str
    prompt: list[int]
    output: list[int]
    prompt_start: int = 0
    arrival_step: int = 0
    max_tokens: int | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class SimConfig:
    """The engine's knobs; defaults are a small GPU's worth of a vLLM deployment."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_kv_blocks: int = 512
    num_spec_tokens: int = 0
    reject_prob: float = 0.3
    async_depth: int = 2
    prefix_caching: bool = True
    # A weight update, then a prefix-cache reset, whenever no request is running: the same
    # tokens route anew (the oracle's weights change), except what a preempted request
    # was given before it.
    reset_prefix_cache_when_idle: bool = False
    keep_manifests: bool = False  # leave them for a trainer instead of releasing after checks
    clear_local_tier_every: int = 0  # steps; a two-tier store then re-reads from Redis
    verify_manifests: bool = True
    max_steps: int = 200_000
    seed: int = 0
    forward_seconds: float = 0.0  # slept per step where the model runs: an engine's pace

    def __post_init__(self) -> None:
        # Checked when made: a bad knob would otherwise surface steps later, as a stall
        # ("no progress") or as numpy's error halfway through a run.
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "async_depth",
                     "max_steps"):
            checks.count(getattr(self, name), name, 1)
        for name in ("num_spec_tokens", "clear_local_tier_every", "seed"):
            checks.count(getattr(self, name), name)
        _probability(self.reject_prob, "reject_prob")
        checks.seconds(self.forward_seconds, "forward_seconds")


@dataclass
class SimReport:
    """What a run did and whether every request got exactly its oracle rows."""

    requests: int = 0
    tokens: int = 0
    rows_verified: int = 0
    steps: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    resets: int = 0
    rejected_tokens: int = 0
    blocks_published: int = 0
    blocks_read: int = 0
    manifests_verified: int = 0
    rows_mismatched: int = 0  # model runs only: rows that differ from a fresh full forward
    step_seconds: list[float] = field(default_factory=list)
    store_stats: StoreStats | None = None
    online: dict[str, np.ndarray] = field(default_factory=dict)  # rows each request received
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


class _Req:
    """Own one request's scheduler view, runner truth and received outputs."""

    def __init__(self, spec: SimRequest, layout: RoutingLayout) -> None:
        self.spec = spec
        self.id = spec.req_id
        self.tokens = spec.tokens
        self.total = len(self.tokens)  # T: the final token count, last one never computed
        self.limit = len(spec.prompt) + (spec.max_tokens or len(spec.output))
        self.hashes = block_hashes(self.tokens, layout.block_size)
        self.known = len(spec.prompt)  # tokens the scheduler has confirmed
        self.computed = 0  # scheduler's optimistic computed count
        self.prefill_target = self.known
        self.true_computed = 0  # the runner's truth
        self.kv_blocks: list[int] = []
        self.inflight = 0
        self.started = False
        self.finished = False
        self.preempted_step = -1
        self.recorded = False  # finished with a manifest
        self.outputs: list[RequestOutput] = []


@dataclass
class _Truth:
    """What the runner really did in one step, per request in batch order."""

    sampled: np.ndarray
    rejected: np.ndarray
    end: np.ndarray  # true computed count after the step


class KVCache:
    """Own the block pool: ref counts, hash -> cached block, LRU order of free blocks."""

    def __init__(self, num_blocks: int, enabled: bool) -> None:
        self.enabled = enabled
        self.refs = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    def lookup(self, hashes: list[bytes]) -> list[int]:
        hit = []
        if self.enabled:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                hit.append(block)
        return hit

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1
            self.free.pop(b, None)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None and self.cached.get(old) == b:
                del self.cached[old]
            self.block_hash[b] = None
            self.refs[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, h: bytes) -> None:
        if self.enabled and self.block_hash[block] is None and h not in self.cached:
            self.block_hash[block] = h
            self.cached[h] = block

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first, as vLLM frees them, so a request's head stays cached longest.
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def reset(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * len(self.block_hash)


class Engine:
    """Own the scheduling loop that drives SchedulerConnector and WorkerConnector."""

    def __init__(self, layout: RoutingLayout, worker: WorkerConnector, config: SimConfig,
                 routes=None) -> None:
        if worker.max_concurrent_batches < config.async_depth:
            raise SimError("the worker's max_concurrent_batches is below async_depth")
        self.layout = layout
        self.worker = worker
        self.config = config
        self.scheduler = SchedulerConnector()
        self.kv = KVCache(config.num_kv_blocks, config.prefix_caching)
        self.rng = np.random.default_rng(config.seed)
        self.routes = routes or OracleRoutes(layout, self.rng)
        self.report = SimReport()
        self._oracle: dict[str, np.ndarray] = {}

    def run(self, workload: list[SimRequest]) -> SimReport:
        bs = self.layout.block_size
        arrivals = deque(sorted((_Req(s, self.layout) for s in workload),
                                key=lambda r: r.spec.arrival_step))
        for r in arrivals:
            if -(-r.total // bs) + 1 > self.config.num_kv_blocks:
                raise SimError(f"request {r.id} needs more KV blocks than the pool holds")
        everyone = list(arrivals)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        inflight: deque = deque()
        step = 0
        sent_generation = 0
        while arrivals or self.waiting or self.running or inflight:
            if step >= self.config.max_steps:
                raise SimError(f"no progress after {step} steps")
            while arrivals and arrivals[0].spec.arrival_step <= step:
                self.waiting.append(self._expect(arrivals.popleft()))
            plan = self._schedule(step)
            metadata = self.scheduler.build_step_metadata()
            began = time.perf_counter()
            if plan or not metadata.is_empty() or metadata.generation != sent_generation:
                self.worker.begin_step(metadata)
                sent_generation = metadata.generation
            spent = time.perf_counter() - began
            if plan:
                batch, rows, truth = self._execute(plan)  # the model: not connector time
                if self.config.forward_seconds:
                    time.sleep(self.config.forward_seconds)
                began = time.perf_counter()
                pending = self.worker.prepare_output(batch, routed_experts=rows)
                pending.enqueue_cpu_copy(truth.sampled, truth.rejected)
                inflight.append((pending, plan, truth))
                spent += time.perf_counter() - began
            if inflight and (len(inflight) >= self.config.async_depth or not plan):
                pending, done_plan, truth = inflight.popleft()
                began = time.perf_counter()
                outputs = pending.process_output()
                spent += time.perf_counter() - began
                self._update(done_plan, truth, outputs)
            if plan:
                self.report.step_seconds.append(spent)
            every = self.config.clear_local_tier_every
            if every and step % every == every - 1 and hasattr(self.worker.store, "clear_local"):
                self.worker.store.clear_local()
            if (self.config.reset_prefix_cache_when_idle and not self.running
                    and not inflight and self.kv.cached):
                self.worker.begin_step(self.scheduler.build_step_metadata())  # finishes first
                self.kv.reset()
                self.scheduler.reset_prefix_cache()
                self.report.resets += 1
                # A reset follows a weight update (RL): the oracle routes anew, the
                # requests that wait included, but a preempted one keeps the rows it was
                # given. A model's weights stay.
                new_weights = getattr(self.routes, "new_weights", None)
                if new_weights is not None:
                    new_weights()
                    for req in self.waiting:
                        given = self._oracle[req.id]
                        self._expect(req)
                        if req.outputs:
                            end = req.outputs[-1].token_end
                            self._oracle[req.id] = np.concatenate(
                                (given[:end], self._oracle[req.id][end:]))
            step += 1
        # The last finishes reach the worker with one more (empty) scheduler step.
        self.worker.begin_step(self.scheduler.build_step_metadata())
        self.report.steps = step
        self.report.blocks_published = self.worker.stats.blocks_published
        self.report.blocks_read = self.worker.stats.blocks_read
        self._verify(everyone)
        return self.report

    # -- scheduling -----------------------------------------------------------------

    def _schedule(self, step: int) -> list[tuple[_Req, int, int, bool]]:
        """Pick (request, token_start, num_tokens, is_prefill) under the token budget."""
        budget = self.config.max_num_batched_tokens
        plan = []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted by an earlier request this step
                continue
            prefill = req.computed < req.prefill_target
            if prefill:
                q = min(req.prefill_target - req.computed, budget)
            else:
                q = min(1 + self.config.num_spec_tokens, req.limit - 1 - req.computed, budget)
            if q <= 0:
                continue
            if not self._grow(req, q, step):
                break
            plan.append((req, req.computed, q, prefill))
            self._advance(req, q, prefill)
            budget -= q
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.inflight or req.preempted_step == step:
                break
            q = self._admit(req, budget)
            if q is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            plan.append((req, req.computed, q, True))
            self._advance(req, q, True)
            budget -= q
        return plan

    def _admit(self, req: _Req, budget: int) -> int | None:
        bs = self.layout.block_size
        req.prefill_target = req.known
        hit = self.kv.lookup(req.hashes[: req.known // bs])
        hit_tokens = min(len(hit) * bs, req.known - 1)  # the last known token is recomputed
        q = min(req.prefill_target - hit_tokens, budget)
        need = -(-(hit_tokens + q) // bs) - len(hit)
        if need > len(self.kv.free) - sum(1 for b in hit if b in self.kv.free):
            return None
        self.kv.take(hit)
        req.kv_blocks = hit + (self.kv.allocate(need) or [])
        req.computed = req.true_computed = hit_tokens
        self.report.prefix_hit_tokens += hit_tokens
        if req.started:
            self.scheduler.resume_request(req.id)
        else:
            req.started = True
            self.scheduler.add_request(req.id, prompt_start=req.spec.prompt_start)
        self.scheduler.update_block_hashes(req.id, req.hashes[: req.known // bs])
        return q

    def _grow(self, req: _Req, q: int, step: int) -> bool:
        """Allocate KV blocks for ``q`` more tokens, preempting from the back if needed."""
        need = -(-(req.computed + q) // self.layout.block_size) - len(req.kv_blocks)
        while need > 0:
            blocks = self.kv.allocate(need)
            if blocks is not None:
                req.kv_blocks.extend(blocks)
                return True
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _expect(self, req: _Req) -> _Req:
        """Fix the rows ``req`` is owed: those of the weights it runs with, known when it
        arrives (and again at a weight update, which waits for the running requests)."""
        self._oracle[req.id] = self.routes.expected(req.id, req.tokens)
        return req

    def _preempt(self, req: _Req, step: int) -> None:
        self.running.remove(req)
        self.kv.release(req.kv_blocks)
        req.kv_blocks = []
        req.preempted_step = step
        self.scheduler.preempt_request(req.id)
        self.waiting.appendleft(req)
        self.report.preemptions += 1

    def _advance(self, req: _Req, q: int, prefill: bool) -> None:
        req.computed += q
        req.inflight += 1
        if prefill:
            # Prompt tokens are known, so their full blocks are cached when scheduled
            # (as vLLM does): a request scheduled later in this batch may hit them.
            bs = self.layout.block_size
            for j in range(min(req.computed, req.known) // bs):
                if j < len(req.kv_blocks):
                    self.kv.cache(req.kv_blocks[j], req.hashes[j])

    # -- the model ------------------------------------------------------------------

    def _execute(self, plan) -> tuple[StepBatch, np.ndarray | None, _Truth]:
        n = len(plan)
        counts = np.array([q for _, _, q, _ in plan], dtype=np.int64)
        qsl = np.concatenate(([0], np.cumsum(counts)))
        padding = int(self.rng.integers(0, 4))
        truth = _Truth(*(np.zeros(n, np.int64) for _ in range(3)))
        chunks = []
        for i, (req, _, q, prefill) in enumerate(plan):
            c = req.true_computed
            if prefill:
                valid = q
                truth.sampled[i] = 1 if c + q == req.prefill_target else 0
            elif c >= req.total - 1:
                valid = q  # finished already (EOS not yet seen by the scheduler): dropped
                truth.sampled[i] = q
            else:
                accepted = 0
                while accepted < q - 1 and self.rng.random() >= self.config.reject_prob:
                    accepted += 1
                valid = min(1 + accepted, req.total - 1 - c)
                truth.sampled[i] = valid
            truth.end[i] = c + valid
            truth.rejected[i] = q - valid
            chunks.append(Chunk(req.id, req.tokens, c, q, valid))
            req.true_computed = c + valid
        rows = self.routes.run(chunks, qsl, padding)
        batch = StepBatch([r.id for r, _, _, _ in plan],
                          np.array([s for _, s, _, _ in plan], dtype=np.int64), qsl)
        return batch, rows, truth

    # -- results --------------------------------------------------------------------

    def _update(self, plan, truth: _Truth, outputs: dict[str, RequestOutput]) -> None:
        bs = self.layout.block_size
        for i, (req, _, _, _) in enumerate(plan):
            req.inflight -= 1
            if req.finished:
                continue  # a step scheduled before the request's end was seen
            out = outputs.get(req.id)
            if out is not None:
                req.outputs.append(out)
                self.scheduler.record_output(req.id, out)
            req.computed -= int(truth.rejected[i])
            self.report.rejected_tokens += int(truth.rejected[i])
            end = int(truth.end[i])
            if truth.sampled[i]:
                req.known = max(req.known, min(end + 1, req.total))
            self.scheduler.update_block_hashes(req.id, req.hashes[: req.known // bs])
            if req in self.running:
                # Decoded blocks are cached once their tokens are confirmed and computed.
                for j in range(min(req.known, end) // bs):
                    if j < len(req.kv_blocks):
                        self.kv.cache(req.kv_blocks[j], req.hashes[j])
            if req.known >= req.total:
                self._finish(req)

    def _finish(self, req: _Req) -> None:
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:  # preempted after its last step: what it was given is whole
            self.waiting.remove(req)
        self.kv.release(req.kv_blocks)
        req.kv_blocks = []
        self.routes.forget(req.id)
        self.scheduler.finish_request(req.id, num_tokens=req.total)
        req.recorded = True

    def _verify(self, everyone: list[_Req]) -> None:
        report = self.report
        for req in everyone:
            report.requests += 1
            report.tokens += req.total
            expected = self._oracle[req.id][req.spec.prompt_start : req.total - 1]
            position = req.spec.prompt_start
            for out in req.outputs:
                if out.token_start != position:
                    report.failures.append(
                        f"{req.id}: output starts at {out.token_start}, expected {position}")
                    break
                position = out.token_end
            else:
                got = (np.concatenate([o.rows for o in req.outputs]) if req.outputs
                       else self.layout.empty_rows())
                report.online[req.id] = got
                if got.shape != expected.shape:
                    report.failures.append(
                        f"{req.id}: {len(got)} rows, expected {len(expected)}")
                elif not np.array_equal(got, expected):
                    differ = (got != expected).any(axis=(1, 2))
                    if self.routes.exact:
                        report.failures.append(f"{req.id}: row for position "
                                               f"{req.spec.prompt_start + int(np.argmax(differ))} "
                                               "differs")
                    else:
                        report.rows_mismatched += int(differ.sum())
                        report.rows_verified += len(got) - int(differ.sum())
                else:
                    report.rows_verified += len(got)
        if self.config.verify_manifests:
            self._verify_manifests(everyone)
        if self.worker.num_requests:
            report.failures.append(f"worker still holds {self.worker.num_requests} request(s)")
        stats = self.worker.store.stats()
        if stats.referenced_keys:
            report.failures.append(f"store still pins {stats.referenced_keys} key(s)")


    def _verify_manifests(self, everyone: list[_Req]) -> None:
        """Read every recorded request back as a trainer would: byte-identical rows."""
        from r3cache.reader import R3Reader

        recorded = [r for r in everyone if r.recorded]
        if not recorded:
            return
        reader = R3Reader(self.worker.store)
        stored = reader.get_many([r.id for r in recorded])
        for req, rows in zip(recorded, stored):
            online = self.report.online.get(req.id)
            if online is None or rows.shape != online.shape or rows.tobytes() != online.tobytes():
                self.report.failures.append(f"{req.id}: manifest rows differ from online rows")
            else:
                self.report.manifests_verified += 1
        if not self.config.keep_manifests:
            reader.release(*(r.id for r in recorded))


def simulate(
    workload: list[SimRequest],
    layout: RoutingLayout,
    config: SimConfig | None = None,
    *,
    store_url: str = "memory://",
    namespace: str = "sim",
    routes=None,
    writer: str = "auto",
    **store_options,
) -> SimReport:
    """Run ``workload`` through a fresh worker connector over the store at ``store_url``.

    ``routes`` is the model: the oracle by default, or an ``r3cache.models.ModelRoutes``
    whose capturer the worker snapshots each step. ``writer`` is the connector's option
    (``"auto"``: a helper process writes a Redis store).
    """
    from r3cache.store import open_store

    config = config or SimConfig()
    store = open_store(store_url, layout=layout, namespace=namespace, **store_options)
    worker = WorkerConnector(
        layout=layout,
        store=store,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_concurrent_batches=config.async_depth,
        capturer=getattr(routes, "capturer", None),
        writer=writer,
    )
    try:
        report = Engine(layout, worker, config, routes).run(workload)
        report.store_stats = worker.store.stats()
        return report
    finally:
        worker.close()


def _probability(value: object, name: str) -> None:
    if not (checks.is_int(value) or isinstance(value, (float, np.floating))) or not (
            0 <= value <= 1):
        raise ContractError(f"{name} must be a probability between 0 and 1, not {value!r:.40}")


def _length_range(bounds: object, name: str, minimum: int) -> tuple[int, int]:
    """``bounds`` as (low, high) for rng.integers: lengths from low up to high - 1."""
    try:
        low, high = bounds  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ContractError(f"{name} is (shortest, longest + 1), not {bounds!r:.40}") from None
    low = checks.count(low, f"{name}[0]", minimum)
    if checks.count(high, f"{name}[1]", minimum) <= low:
        raise ContractError(f"{name} is (shortest, longest + 1): {high} is not above {low}")
    return low, high


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def grpo_workload(
    *,
    num_prompts: int = 16,
    samples: int = 8,
    system_len: int = 64,
    prompt_len: tuple[int, int] = (32, 320),
    output_len: tuple[int, int] = (16, 384),
    vocab: int = 151_936,
    seed: int = 0,
) -> list[SimRequest]:
    """GRPO-like rollouts: every prompt sampled ``samples`` times, all under one system prompt."""
    num_prompts = checks.count(num_prompts, "num_prompts", 1)
    samples = checks.count(samples, "samples", 1)
    system_len = checks.count(system_len, "system_len")
    # A prompt has a token at least: its system part, or its own.
    prompt_len = _length_range(prompt_len, "prompt_len", 0 if system_len else 1)
    output_len = _length_range(output_len, "output_len", 1)  # the last token ends it
    vocab = checks.count(vocab, "vocab", 1)
    rng = np.random.default_rng(checks.count(seed, "seed"))
    system = _tokens(rng, system_len, vocab)
    workload = []
    for p in range(num_prompts):
        prompt = system + _tokens(rng, int(rng.integers(*prompt_len)), vocab)
        for s in range(samples):
            output = _tokens(rng, int(rng.integers(*output_len)), vocab)
            workload.append(SimRequest(f"prompt{p}-sample{s}", prompt, output,
                                       max_tokens=output_len[1]))
    return workload


def random_workload(
    seed: int, *, num_requests: int = 12, block_size: int = 16, vocab: int = 1000
) -> list[SimRequest]:
    """Requests in prefix-sharing families with random lengths, arrivals and prompt starts."""
    num_requests = checks.count(num_requests, "num_requests", 1)
    block_size = checks.count(block_size, "block_size", 1)
    vocab = checks.count(vocab, "vocab", 1)
    rng = np.random.default_rng(checks.count(seed, "seed"))
    roots = [_tokens(rng, int(rng.integers(1, 6 * block_size)), vocab) for _ in range(3)]
    workload = []
    for i in range(num_requests):
        root = roots[int(rng.integers(len(roots)))]
        # Cut the shared part at a block boundary half of the time, anywhere otherwise.
        shared = int(rng.integers(0, len(root) + 1))
        if rng.random() < 0.5:
            shared -= shared % block_size
        own = int(rng.integers(0 if shared else 1, 3 * block_size))
        prompt = root[:shared] + _tokens(rng, own, vocab)
        output = _tokens(rng, int(rng.integers(1, 5 * block_size)), vocab)
        prompt_start = int(rng.choice([0, rng.integers(0, len(prompt) + 1), len(prompt)]))
        max_tokens = len(output) + int(rng.integers(0, 8))
        workload.append(SimRequest(f"r{i}", prompt, output, prompt_start,
                                   arrival_step=int(rng.integers(0, 40)), max_tokens=max_tokens))
    return workload
