"""Forward time of tiny transformers MoE models with and without r3cache capture hooks (CPU).

Each family is built with --layers decoder layers (9 by default: at least 8 MoE layers in
every family, the first layer being dense in Qwen and DeepSeek-V3), run in float32 under
inference mode, and timed for a prefill-shaped forward
(one sequence of --prefill tokens) and a decode-shaped forward (--batch sequences of one
token). Runs with and without hooks alternate, so drift hits both; the table gives medians.

    python scripts/bench_capture.py [--layers 9] [--repeats 40]

The last line times one hook's work alone: ``capture()`` of one layer's indices.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from r3cache.models import tiny_model, tiny_model_names
from r3cache.routers import bind, capturer_for

warnings.filterwarnings("ignore")


def timed(model, ids) -> float:
    began = time.perf_counter()
    with torch.inference_mode():
        model(ids)
    return time.perf_counter() - began


def measure(model, capturer, ids, repeats: int) -> tuple[float, float, float]:
    """Medians of bare and hooked forwards, and the median of their paired differences
    (adjacent runs share the machine's state, so the pairing cancels most drift)."""
    bare, hooked = [], []
    for _ in range(3):  # warm-up
        timed(model, ids)
    for _ in range(repeats):
        bare.append(timed(model, ids))
        with bind(model, capturer):
            hooked.append(timed(model, ids))
    paired = statistics.median(h - b for h, b in zip(hooked, bare))
    return statistics.median(bare), statistics.median(hooked), paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = {"prefill": (1, args.prefill), "decode": (args.batch, 1)}
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, "
          f"{args.layers} decoder layers, median of {args.repeats}")
    print(f"{'model':<18} {'MoE layers':>10} {'forward':>8} {'tokens':>6} "
          f"{'bare ms':>8} {'hooked ms':>9} {'overhead (paired)':>17}")
    worst = 0.0
    for name in tiny_model_names():
        model = tiny_model(name, num_layers=args.layers, dtype=torch.float32)
        capturer = capturer_for(model, max(args.prefill, args.batch))
        for shape_name, shape in shapes.items():
            ids = torch.randint(0, 512, shape)
            bare, hooked, paired = measure(model, capturer, ids, args.repeats)
            overhead = paired / bare
            if len(capturer.moe_layers) >= 8:
                worst = max(worst, overhead)
            print(f"{name:<18} {len(capturer.moe_layers):>10} {shape_name:>8} "
                  f"{shape[0] * shape[1]:>6} {bare * 1e3:>8.3f} {hooked * 1e3:>9.3f} "
                  f"{paired * 1e3:>8.3f} ms {overhead * 100:>5.1f}%")
    print(f"worst overhead with >= 8 MoE layers: {worst * 100:.1f}% (target <= 5%)")
    ids = torch.randint(0, capturer.layout.num_experts, (args.batch, capturer.layout.topk))
    calls = 20_000
    began = time.perf_counter()
    for _ in range(calls):
        capturer.capture(capturer.moe_layers[0], ids)
    per_call = (time.perf_counter() - began) / calls
    print(f"capture() of {args.batch} tokens x top-{capturer.layout.topk}, one layer: "
          f"{per_call * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
