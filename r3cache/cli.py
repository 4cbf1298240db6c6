"""The ``r3cache`` command line."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from urllib.parse import unquote

import numpy as np

from r3cache.errors import BlockNotFoundError, ContractError, NamespaceNotFoundError, R3Error
from r3cache.layout import RoutingLayout
from r3cache.sim import SimConfig, SimReport, grpo_workload, simulate
from r3cache.store import check_url, display_url, without_engine_options


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="run GRPO-like rollouts through the simulator and verify every stored route",
        description=(
            "Simulate an inference engine (continuous batching, prefix cache, chunked "
            "prefill, speculative decoding, async scheduling) generating GRPO rollouts: "
            "PROMPTS prompts x SAMPLES samples each. Routed experts flow through the "
            "worker connector into the store at --store; every request's rows are checked "
            "against the routing oracle. With --model, a tiny randomly initialised "
            "transformers MoE model computes the routes instead (router hooks -> capturer "
            "-> host copy -> connector), and every request's stored routes are checked "
            "against a fresh full forward of that request."
        ),
        epilog="examples:\n  r3cache demo\n  r3cache demo --store redis://127.0.0.1:6379/0\n"
               "  r3cache demo --model qwen3-moe-tiny --model-layers 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--store", default="memory://", help="block store URL (default: %(default)s)")
    demo.add_argument("--namespace", default="demo@sim", help="namespace tied to the weights")
    demo.add_argument("--prompts", type=_positive, default=None,
                      help="distinct prompts (default: 16, or 4 with --model)")
    demo.add_argument("--samples", type=_positive, default=None,
                      help="samples per prompt (default: 8, or 4 with --model)")
    demo.add_argument("--model", default=None, metavar="NAME",
                      help="compute routes with a tiny transformers MoE model: "
                           "mixtral-tiny, qwen2-moe-tiny, qwen3-moe-tiny, olmoe-tiny, "
                           "deepseek-v3-tiny, gpt-oss-tiny (those the installed "
                           "transformers has); needs the 'models' extra")
    demo.add_argument("--model-layers", type=_positive, default=4,
                      help="decoder layers of the tiny model (default: %(default)s)")
    demo.add_argument("--route-layers", choices=("moe", "all"), default="moe",
                      help="with --model: keep MoE layers only, or every decoder layer "
                           "(dense layers then hold the filler 0..topk-1)")
    demo.add_argument("--layers", type=_positive, default=48, help="oracle layout: MoE layers")
    demo.add_argument("--topk", type=_positive, default=8, help="oracle layout: experts per token")
    demo.add_argument("--experts", type=_positive, default=128, help="oracle layout: experts")
    demo.add_argument("--block-size", type=_positive, default=16,
                      help="tokens per stored block, the KV block size (default: %(default)s)")
    demo.add_argument("--spec-tokens", type=_non_negative, default=3,
                      help="draft tokens per decode step")
    demo.add_argument("--async-depth", type=int, default=2, choices=(1, 2),
                      help="steps in flight before the oldest is processed (default: %(default)s)")
    demo.add_argument("--max-num-seqs", type=_positive, default=64,
                      help="most requests running at once (default: %(default)s)")
    demo.add_argument("--max-batched-tokens", type=_positive, default=2048,
                      help="most tokens in one engine step (default: %(default)s)")
    demo.add_argument("--kv-blocks", type=_positive, default=512,
                      help="KV cache pool in blocks; small enough to force preemptions")
    demo.add_argument("--seed", type=_non_negative, default=0,
                      help="seed of the workload, the sampler and the tiny model (default: 0)")
    demo.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    check_url(args.store, args.namespace)  # before a model loads or a workload is drawn
    routes = None
    if args.model:
        from r3cache.models import ModelRoutes, tiny_model

        model = tiny_model(args.model, num_layers=args.model_layers, seed=args.seed)
        routes = ModelRoutes(model, args.max_batched_tokens, layers=args.route_layers,
                             block_size=args.block_size)
        layout = routes.layout
        # A CPU forward per scheduled chunk: a smaller workload over the model's vocabulary.
        workload = grpo_workload(num_prompts=args.prompts or 4, samples=args.samples or 4,
                                 system_len=32, prompt_len=(16, 96), output_len=(8, 96),
                                 vocab=routes.vocab_size, seed=args.seed)
    else:
        layout = RoutingLayout(args.layers, args.topk, args.experts, args.block_size)
        workload = grpo_workload(num_prompts=args.prompts or 16, samples=args.samples or 8,
                                 seed=args.seed)
    config = SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        num_kv_blocks=args.kv_blocks,
        num_spec_tokens=args.spec_tokens,
        async_depth=args.async_depth,
        seed=args.seed,
    )
    began = time.perf_counter()
    try:
        report = simulate(workload, layout, config, store_url=args.store,
                          namespace=args.namespace, routes=routes)
    finally:
        if routes is not None:
            routes.close()
    print(_format_report(report, layout, display_url(args.store),
                         time.perf_counter() - began, args.model))
    return 0 if report.ok else 1


def _format_report(report: SimReport, layout: RoutingLayout, url: str, seconds: float,
                   model: str | None = None) -> str:
    stats = report.store_stats
    steps = np.array(report.step_seconds) * 1e3
    owed = report.rows_verified + report.rows_mismatched
    inline = owed * layout.num_layers * layout.topk * 4
    source = f"model={model}" if model else "routes=oracle"
    lines = [
        f"r3cache demo  store={url}  {source}  layout={layout.fingerprint}",
        f"  requests              {report.requests}",
        f"  tokens                {report.tokens}  ({owed} routed rows owed)",
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
    if model:
        lines.append(f"  vs a fresh forward    {report.rows_verified} rows equal, "
                     f"{report.rows_mismatched} differ (a KV-cached, chunked forward need not "
                     "be batch-invariant; differences are reported, not hidden)")
    if report.ok:
        reference = "a fresh full forward" if model else "the oracle"
        lines.append(f"verification: PASS (stored rows of {report.requests} requests equal "
                     f"what they received online; {report.rows_verified} of {owed} rows equal "
                     f"{reference}; no state or pins left)")
    else:
        lines.append(f"verification: FAIL ({len(report.failures)} problem(s))")
        lines.extend(f"  - {f}" for f in report.failures[:20])
    return "\n".join(lines)


_NAMESPACE_HELP = "the namespace the engine wrote to (r3cache inspect URL lists them)"


def _gc_parser(sub: argparse._SubParsersAction) -> None:
    gc = sub.add_parser(
        "gc",
        help="release the holds of engines whose lease expired (crashed owners)",
        description=(
            "Every engine that opens a namespace holds a lease (an expiry in the "
            "namespace's owners hash) that its heartbeat extends. gc finds owners whose "
            "lease expired, and holders no owner entry names, and drops their holds, so "
            "the blocks they pinned get the idle TTL. Engines also run it when they start."
        ),
    )
    gc.add_argument("url", help="redis://, rediss://, unix:// or redis+cluster:// URL")
    gc.add_argument("--namespace", action="append",
                    help="namespace to clean (repeatable; default: every namespace)")
    gc.set_defaults(func=_run_gc)


def _run_gc(args: argparse.Namespace) -> int:
    from r3cache.store.redis.connect import list_namespaces, open_redis_store
    from r3cache.store.redis.janitor import reclaim_dead_owners

    namespaces = args.namespace or list_namespaces(args.url)
    if not namespaces:
        print("no r3cache namespaces found")
    for namespace in namespaces:
        try:
            store = open_redis_store(args.url, layout=None, namespace=namespace,
                                     lease=False, janitor=False)
        except NamespaceNotFoundError:
            if args.namespace:
                raise
            continue  # deleted since the listing, as inspection.looks passes it over
        try:
            report = reclaim_dead_owners(store)
        finally:
            store.close()
        print(f"{namespace}: {len(report.live_owners)} live owner(s), "
              f"{len(report.dead_owners)} dead owner(s) reclaimed, "
              f"{report.holds_dropped} hold(s) dropped, "
              f"{report.manifests_expired} expired manifest(s) released"
              + (f" ({len(report.unreadable_manifests)} unreadable)"
                 if report.unreadable_manifests else ""))
        for owner in report.dead_owners:
            print(f"  reclaimed {owner}")
        for owner in report.unregistered_holders:
            print(f"  unregistered holder {owner} (reclaimed after one lease unless it beats)")
    return 0


def _block_parser(sub: argparse._SubParsersAction) -> None:
    block = sub.add_parser(
        "block",
        help="decode one stored block: header, TTL, holders and its rows",
        description=(
            "Read one block of routed experts by its KV block hash (the hex digest that "
            "follows 'b:' in its Redis key) and print what it holds. --out saves the "
            "rows, shape (block_size, num_layers, topk), to a .npy or .safetensors file."
        ),
    )
    block.add_argument("url", help="redis://, rediss://, unix:// or redis+cluster:// URL")
    block.add_argument("block_hash", help="the block's hash, as in r3:NS:b:{HASH}")
    block.add_argument("--namespace", required=True, help=_NAMESPACE_HELP)
    block.add_argument("--out", help="write the rows to this .npy or .safetensors file")
    block.set_defaults(func=_run_block)


def _run_block(args: argparse.Namespace) -> int:
    from r3cache.codec import read_header
    from r3cache.store.redis.connect import open_redis_store
    from r3cache.store.redis.nodes import hash_reply

    save = _saver(args.out) if args.out else None  # before the read, as for get
    store = open_redis_store(args.url, layout=None, namespace=args.namespace,
                             lease=False, janitor=False)
    try:
        key, refs = store.keys.block(args.block_hash), store.keys.refs(args.block_hash)
        value = store.call(key, "GET", key)
        holders = hash_reply(store.call(refs, "HGETALL", refs))
        ttl = store.call(key, "PTTL", key)
        if value is None:
            raise BlockNotFoundError([args.block_hash], namespace=args.namespace)
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
    if save:
        save(rows)
        print(f"saved     {args.out}")
    return 0


def _read_parsers(sub: argparse._SubParsersAction) -> None:
    url_help = "redis://, rediss://, unix:// or redis+cluster:// URL"
    inspect = sub.add_parser(
        "inspect", help="what a Redis holds: namespaces, layouts, blocks, manifests, owners",
        description="Without --namespace, one line per namespace; with it, the namespace's "
        "layout, block and manifest counts, bytes used, pinned vs idle blocks, and live "
        "and dead owners. It scans keys (SCAN, never KEYS): fine for a look, not a loop.")
    inspect.add_argument("url", help=url_help)
    inspect.add_argument("--namespace",
                         help="one namespace in detail (default: one line per namespace)")
    inspect.set_defaults(func=_run_inspect)

    top = sub.add_parser(
        "top", help="a live view of the namespaces and the server's memory (q quits)",
        description="Redraws what inspect shows, Redis used_memory against maxmemory and "
        "its eviction policy (warning unless volatile-*), and the rates of blocks and "
        "manifests stored since the last redraw. Each redraw scans the namespaces' keys: "
        "set --interval for large ones. q or Ctrl-C quits.")
    top.add_argument("url", help=url_help)
    top.add_argument("--namespace", help="one namespace (default: every namespace)")
    top.add_argument("--interval", type=_positive_seconds, default=2.0, metavar="SECONDS",
                     help="seconds between redraws (default 2)")
    top.set_defaults(func=_run_top)

    get = sub.add_parser(
        "get", help="one request's routes into a .npy or .safetensors file",
        description="Read a finished request's routes (validated) and save them with shape "
        "(num_tokens - 1 - prompt_start, num_layers, topk). .safetensors needs the "
        "'safetensors' package (pip install 'r3cache[cli]').")
    get.add_argument("url", help=url_help)
    get.add_argument("request_id", help="the id the rollout response carries")
    get.add_argument("--namespace", required=True, help=_NAMESPACE_HELP)
    get.add_argument("--out", required=True, help="routes.npy or routes.safetensors")
    get.add_argument("--dtype", default=None, help="e.g. int32 or int64 (default: stored)")
    get.set_defaults(func=_run_get)

    export = sub.add_parser(
        "export", help="every recorded request of a namespace into a directory of .npy files",
        description="Writes one .npy file per manifest in the namespace (named by its "
        "position and the request id's safe characters) and DIR/index.json mapping each "
        "request id to its file, prompt_start and token count.")
    export.add_argument("url", help=url_help)
    export.add_argument("--namespace", required=True, help=_NAMESPACE_HELP)
    export.add_argument("--out", required=True, help="directory to create or fill")
    export.add_argument("--dtype", default=None,
                        help="e.g. int32 or int64 (default: stored)")
    export.add_argument("--batch", type=_positive, default=16, help="requests per read")
    export.set_defaults(func=_run_export)

    plot = sub.add_parser(
        "plot", help="expert load per layer as a heatmap (needs matplotlib)",
        description="Counts how often each expert was routed to, per layer, over one "
        "request or every recorded request of the namespace, and draws layers x experts.")
    plot.add_argument("url", help=url_help)
    plot.add_argument("request_id", nargs="?", help="one request (default: the namespace)")
    plot.add_argument("--namespace", required=True, help=_NAMESPACE_HELP)
    plot.add_argument("--out", required=True, metavar="PNG",
                      help="image file to write, e.g. load.png")
    plot.set_defaults(func=_run_plot)


def _recorded(reader) -> list[str]:
    index = reader.store.keys.manifest_index
    return [r.decode() for r in reader.store.call(index, "ZRANGE", index, 0, -1)]


def _each_recorded(reader, ids: list[str], batch: int, dtype=None, skipped: list | None = None):
    """(request id, manifest, rows) of each of ``ids`` still recorded when read, ``batch``
    at a time. A trainer reading beside this one releases what it read, and the janitor
    what expired: a manifest gone since ``ids`` were listed is skipped (its id appended to
    ``skipped``), not the end of the run."""
    from r3cache.errors import ManifestNotFoundError

    skipped = [] if skipped is None else skipped
    for at in range(0, len(ids), batch):
        left = ids[at : at + batch]
        while left:
            manifests = dict(zip(left, reader.store.get_manifests(left)))
            present = [r for r in left if manifests[r] is not None]
            skipped += (r for r in left if manifests[r] is None)
            try:
                rows = reader.get_many(present, dtype=dtype) if present else []
            except ManifestNotFoundError as exc:  # released between the two reads
                gone = set(exc.request_ids)
                skipped += (r for r in present if r in gone)
                left = [r for r in present if r not in gone]
                continue
            yield from zip(present, map(manifests.__getitem__, present), rows)
            break


def _run_inspect(args: argparse.Namespace) -> int:
    from r3cache.inspection import describe, looks

    views = looks(args.url, args.namespace)
    if not views:
        print("no r3cache namespaces found")
    for view in views:
        print("\n".join(describe(view)))
    return 0


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and "
                                         "below a day")
    return seconds


def _run_top(args: argparse.Namespace) -> int:
    from r3cache.top import run

    return run(args.url, args.namespace, args.interval)


def _run_get(args: argparse.Namespace) -> int:
    from r3cache.reader import R3Reader

    save = _saver(args.out)  # before the read: a file it cannot write wastes none
    with R3Reader(args.url, namespace=args.namespace) as reader:
        rows = reader.get(args.request_id, dtype=args.dtype)
    save(rows)
    print(f"{args.request_id}: {rows.shape} {rows.dtype} -> {args.out}")
    return 0


def _saver(path: str) -> Callable[[np.ndarray], None]:
    """What writes rows to exactly ``path``: a .npy or a .safetensors file (np.save would
    write ``routes`` to routes.npy, and the line printed would name another file)."""
    if path.endswith(".npy"):
        return partial(np.save, path)
    if not path.endswith(".safetensors"):
        raise ContractError(f"--out {path}: name a .npy or a .safetensors file")
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ContractError("writing .safetensors needs the safetensors package: pip "
                            "install 'r3cache[cli]'") from None
    return lambda rows: save_file({"routed_experts": np.ascontiguousarray(rows)}, path)


def _run_export(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from tqdm import tqdm

    from r3cache.reader import R3Reader

    out = Path(args.out)
    index, skipped = [], []
    with R3Reader(args.url, namespace=args.namespace) as reader:
        # An empty read checks the dtype: a namespace that is not there, or a dtype that
        # cannot hold its expert IDs, is refused before the directory is made.
        reader.get_many([], dtype=args.dtype)
        out.mkdir(parents=True, exist_ok=True)
        ids = _recorded(reader)
        with tqdm(total=len(ids), unit="req", desc="export", disable=None) as bar:
            for request_id, manifest, rows in _each_recorded(reader, ids, args.batch,
                                                             args.dtype, skipped):
                name = _file_name(len(index), request_id)
                np.save(out / name, rows)
                index.append({"request_id": request_id, "file": name,
                              "prompt_start": manifest.completion.prompt_start,
                              "num_tokens": manifest.completion.num_tokens,
                              "shape": list(rows.shape), "dtype": str(rows.dtype)})
                bar.update()
    (out / "index.json").write_text(json.dumps(
        {"namespace": args.namespace, "layout": reader.layout.fingerprint,
         "requests": index}, indent=1))
    gone = f"; {len(skipped)} released while exporting, skipped" if skipped else ""
    print(f"exported {len(index)} request(s) to {out}{gone}")
    return 0


def _file_name(position: int, request_id: str) -> str:
    """A file name inside the export directory for any request id: its position keeps it
    unique, the id's safe characters keep it recognisable (the id itself is in index.json)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", request_id).strip(".")[:80]
    return f"{position:06d}-{safe}.npy" if safe else f"{position:06d}.npy"


def _positive(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
    return value


def _run_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        raise ContractError("plot needs the matplotlib package: pip install "
                            "'r3cache[cli]'") from None
    from r3cache.reader import R3Reader

    # Checked before the reads: savefig would refuse the format only after all of them.
    suffix = args.out.rpartition(".")[2].lower() if "." in args.out.rpartition("/")[2] else ""
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ContractError(f"--out {args.out}: matplotlib writes no .{suffix}; use one of "
                            + ", ".join(f".{f}" for f in sorted(formats)))

    with R3Reader(args.url, namespace=args.namespace) as reader:
        layout = reader.layout
        if args.request_id:
            read = [(args.request_id, None, reader.get(args.request_id))]
        else:
            read = _each_recorded(reader, _recorded(reader), 16)
        load = np.zeros((layout.num_layers, layout.num_experts), np.int64)
        count = 0
        for _, _, rows in read:
            count += 1
            for layer in range(layout.num_layers):
                load[layer] += np.bincount(rows[:, layer].ravel(), minlength=layout.num_experts)
    figure, axes = plt.subplots(figsize=(10, 0.12 * layout.num_layers + 2))
    # Load against a uniform router (every expert topk/num_experts of a layer's
    # routings): 1 is balanced, whatever the token count, so near-uniform load looks
    # near-uniform instead of stretched over the data's own range.
    uniform = max(load.sum() / load.size, 1e-12)
    relative = load / uniform
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(float(relative.max()), 1.0 + 1e-6))
    image = axes.imshow(relative, aspect="auto", cmap="RdBu_r", norm=norm,
                        interpolation="nearest")
    axes.set_xlabel("expert")
    axes.set_ylabel("layer")
    what = args.request_id or f"{count} requests"
    axes.set_title(f"expert load per layer: {args.namespace}, {what}")
    figure.colorbar(image, ax=axes, label="load / uniform load (1 = balanced)")
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"{what}: {int(load.sum())} routings over {layout.num_layers} layers -> {args.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (and exit 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="r3cache",
        description="Routed experts of MoE models, from inference to training (R3).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _gc_parser(sub)
    _block_parser(sub)
    _read_parsers(sub)
    return parser


def _redacted(text: str, argv: list[str]) -> str:
    """``text`` with the password of any URL on the command line blotted out."""
    for arg in argv:
        # The netloc as urlsplit cuts it, without its checks: a URL it refuses (a bracket
        # left open) is the very error being printed.
        netloc = re.split("[/?#]", arg.partition("://")[2], maxsplit=1)[0]
        password = netloc.rpartition("@")[0].partition(":")[2]
        for secret in {password, unquote(password)} - {""}:
            text = text.replace(secret, "***")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "url", None):  # the engine's R3CACHE_URL will do, as for R3Reader
        args.url = without_engine_options(args.url)
    try:
        return args.func(args)
    except R3Error as exc:
        message = f"{type(exc).__name__}: {exc}"
    except OSError as exc:  # a file the command was told to write or read
        message = f"{exc.strerror or type(exc).__name__}: {exc.filename or exc}"
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        message = f"unexpected {type(exc).__name__}: {exc}"
    print(f"r3cache {args.command}: " + _redacted(message, argv).splitlines()[0],
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
