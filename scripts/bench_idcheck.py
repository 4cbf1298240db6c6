"""The expert-ID check of one engine step: the compiled word kernel against numpy.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_idcheck.py [--tokens 8192] [--rounds 5]

Every step's rows are checked before anything is stored (``RoutingLayout.id_problem``):
IDs in range, and no expert twice in one (token, layer). For rows of eight bytes both
run in one pass of ``r3cache.wordcheck``'s numba kernel; the other layouts take numpy's
reductions (``ids_outside``) and column compares (``repeats_by_columns``). Both run here
on the same rows, per
layout with eight-byte rows, in paired rounds whose order alternates; a ratio is the
median of the per-round ratios of median times. Decode (256 tokens) and a chunked
prefill step (8192 tokens) are the sizes bench_vs_vllm.py's scenarios check.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import numpy as np

from r3cache import RoutingLayout
from r3cache.layout import ids_outside, repeats_by_columns
from r3cache.sim import oracle_rows
from r3cache.wordcheck import problems_in_words

LAYOUTS = [  # topk x dtype = eight bytes
    ("topk 8 of 128 (uint8)", RoutingLayout(num_layers=48, topk=8, num_experts=128)),
    ("topk 4 of 512 (uint16)", RoutingLayout(num_layers=48, topk=4, num_experts=512)),
    ("topk 2 of 100000 (int32)", RoutingLayout(num_layers=48, topk=2, num_experts=100000)),
]


def kernel_check(rows: np.ndarray, num_experts: int) -> bool:
    return any(problems_in_words(rows, num_experts))


def numpy_check(rows: np.ndarray, num_experts: int) -> bool:
    return ids_outside(rows, num_experts) or repeats_by_columns(rows)


def median_us(check, rows: np.ndarray, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        assert not check(rows)
        times.append(time.perf_counter() - began)
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, action="append")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}; median us per check; kernel/numpy per round")
    for label, layout in LAYOUTS:
        layout.prepare_checks()  # compile (or load) the kernel outside the timings
        for tokens in args.tokens or [256, 8192]:
            rows = oracle_rows(list(range(tokens)), layout)
            timed = {"kernel": [], "numpy": []}
            pair = [("kernel", functools.partial(kernel_check, num_experts=layout.num_experts)),
                    ("numpy", functools.partial(numpy_check, num_experts=layout.num_experts))]
            for round_ in range(args.rounds):
                for name, check in pair[:: 1 if round_ % 2 == 0 else -1]:
                    timed[name].append(median_us(check, rows, args.repeats))
            ratio = np.median(np.array(timed["kernel"]) / np.array(timed["numpy"]))
            print(f"{label:26s} {tokens:5d} tokens: kernel {np.median(timed['kernel']):8.1f}"
                  f"  numpy {np.median(timed['numpy']):8.1f}  {ratio:.3f}x", flush=True)


if __name__ == "__main__":
    main()
