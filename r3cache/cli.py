"""The ``r3cache`` command line."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from r3cache.errors import R3Error
from r3cache.layout import RoutingLayout
from r3cache.sim import SimConfig, SimReport, grpo_workload, simulate


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="run GRPO-like rollouts through the simulator and verify every stored route",
        description=(
            "Simulate an inference engine (continuous batching, prefix cache, chunked "
            "prefill, speculative decoding, async scheduling) generating GRPO rollouts: "
            "PROMPTS prompts x SAMPLES samples each. Routed experts flow through the "
            "worker connector into the store at --store; every request's rows are checked "
            "against the routing oracle."
        ),
    )
    demo.add_argument("--store", default="memory://", help="block store URL (default: %(default)s)")
    demo.add_argument("--namespace", default="demo@sim", help="namespace tied to the weights")
    demo.add_argument("--prompts", type=int, default=16)
    demo.add_argument("--samples", type=int, default=8)
    demo.add_argument("--layers", type=int, default=48)
    demo.add_argument("--topk", type=int, default=8)
    demo.add_argument("--experts", type=int, default=128)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--spec-tokens", type=int, default=3, help="draft tokens per decode step")
    demo.add_argument("--async-depth", type=int, default=2, choices=(1, 2))
    demo.add_argument("--max-num-seqs", type=int, default=64)
    demo.add_argument("--max-batched-tokens", type=int, default=2048)
    demo.add_argument("--kv-blocks", type=int, default=512,
                      help="KV cache pool in blocks; small enough to force preemptions")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    layout = RoutingLayout(args.layers, args.topk, args.experts, args.block_size)
    workload = grpo_workload(num_prompts=args.prompts, samples=args.samples, seed=args.seed)
    config = SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        num_kv_blocks=args.kv_blocks,
        num_spec_tokens=args.spec_tokens,
        async_depth=args.async_depth,
        seed=args.seed,
    )
    began = time.perf_counter()
    report = simulate(workload, layout, config, store_url=args.store, namespace=args.namespace)
    print(_format_report(report, layout, args.store, time.perf_counter() - began))
    return 0 if report.ok else 1


def _format_report(report: SimReport, layout: RoutingLayout, url: str, seconds: float) -> str:
    stats = report.store_stats
    steps = np.array(report.step_seconds) * 1e3
    inline = report.rows_verified * layout.num_layers * layout.topk * 4
    lines = [
        f"r3cache demo  store={url}  layout={layout.fingerprint}",
        f"  requests              {report.requests}",
        f"  tokens                {report.tokens}  ({report.rows_verified} routed rows owed)",
        f"  engine steps          {report.steps}  (preemptions {report.preemptions}, "
        f"rejected draft tokens {report.rejected_tokens})",
        f"  prefix-hit tokens     {report.prefix_hit_tokens}",
        f"  blocks published      {report.blocks_published}",
        f"  blocks reused         {report.blocks_read}  (read back for prefix hits)",
        f"  bytes as inline int32 {inline:,}",
        f"  raw bytes stored      {stats.raw_bytes_used:,}  ({stats.blocks} blocks, "
        f"{layout.dtype} rows, shared prefixes stored once)",
        f"  bytes in the store    {stats.bytes_used:,}",
        f"  connector time/step   median {np.median(steps):.3f} ms, "
        f"p90 {np.percentile(steps, 90):.3f} ms over {len(steps)} steps",
        f"  wall time             {seconds:.2f} s",
    ]
    if report.ok:
        lines.append(f"verification: PASS ({report.rows_verified} rows of "
                     f"{report.requests} requests equal the oracle; no state or pins left)")
    else:
        lines.append(f"verification: FAIL ({len(report.failures)} problem(s))")
        lines.extend(f"  - {f}" for f in report.failures[:20])
    return "\n".join(lines)


def _gc_parser(sub: argparse._SubParsersAction) -> None:
    gc = sub.add_parser(
        "gc",
        help="release the holds of engines whose lease expired (crashed owners)",
        description=(
            "Every engine that opens a namespace keeps a heartbeat key with a TTL. "
            "gc finds owners whose heartbeat expired and drops their holds, so the "
            "blocks they pinned get the idle TTL. Engines also run it when they start."
        ),
    )
    gc.add_argument("url", help="redis://, rediss://, unix:// or redis+cluster:// URL")
    gc.add_argument("--namespace", action="append",
                    help="namespace to clean (repeatable; default: every namespace)")
    gc.set_defaults(func=_run_gc)


def _run_gc(args: argparse.Namespace) -> int:
    from r3cache.store.janitor import list_namespaces, reclaim_dead_owners
    from r3cache.store.redis_connect import open_redis_store

    namespaces = args.namespace or list_namespaces(args.url)
    if not namespaces:
        print("no r3cache namespaces found")
    for namespace in namespaces:
        store = open_redis_store(args.url, layout=None, namespace=namespace,
                                 lease=False, janitor=False)
        try:
            report = reclaim_dead_owners(store)
        finally:
            store.close()
        print(f"{namespace}: {len(report.live_owners)} live owner(s), "
              f"{len(report.dead_owners)} dead owner(s) reclaimed, "
              f"{report.holds_dropped} hold(s) dropped, "
              f"{report.manifests_expired} expired manifest(s) released")
        for owner in report.dead_owners:
            print(f"  reclaimed {owner}")
    return 0


def _block_parser(sub: argparse._SubParsersAction) -> None:
    block = sub.add_parser(
        "block",
        help="decode one stored block: header, TTL, holders and its rows",
        description=(
            "Read one block of routed experts by its KV block hash (the hex digest that "
            "follows 'b:' in its Redis key) and print what it holds. --out saves the "
            "rows, shape (block_size, num_layers, topk), as a .npy file."
        ),
    )
    block.add_argument("url", help="redis://, rediss://, unix:// or redis+cluster:// URL")
    block.add_argument("block_hash", help="the block's hash, as in r3:NS:b:{HASH}")
    block.add_argument("--namespace", required=True)
    block.add_argument("--out", help="write the rows to this .npy file")
    block.set_defaults(func=_run_block)


def _run_block(args: argparse.Namespace) -> int:
    from r3cache.codec import read_header
    from r3cache.store.redis_connect import open_redis_store

    store = open_redis_store(args.url, layout=None, namespace=args.namespace,
                             lease=False, janitor=False)
    try:
        key = store.keys.block(args.block_hash)
        client = store.client_for(key)
        value = client.get(key)
        holders = client.hgetall(store.keys.refs(args.block_hash))
        ttl = client.pttl(key)
        if value is None:
            print(f"no block {args.block_hash} in namespace {args.namespace!r}")
            return 1
        header = read_header(value, args.block_hash)
        rows = store.get_concatenated([args.block_hash])
    finally:
        store.close()
    print(f"key       {key.decode()}")
    print(f"layout    {header.fingerprint}")
    print(f"codec     {header.codec_name}, {len(value)} bytes stored, {header.raw_len} raw")
    print(f"ttl       {'none (pinned)' if ttl == -1 else f'{ttl / 1000:.1f} s'}")
    print("holders   " + (", ".join(f"{o.decode()}={int(n)}" for o, n in holders.items())
                         or "none"))
    print(f"rows      {rows.shape} {rows.dtype}; token 0, layer 0: {rows[0, 0].tolist()}")
    if args.out:
        np.save(args.out, rows)
        print(f"saved     {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="r3cache",
        description="Routed experts of MoE models, from inference to training (R3).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _gc_parser(sub)
    _block_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except R3Error as exc:
        print(f"r3cache {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
