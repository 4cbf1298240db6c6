"""Run vLLM on the tiny model in this process and save what it returned: a test's engine.

    python generate.py MODEL OUT.npz --prompts P.json [--max-tokens N] [--rounds R] [--n N]
        [--request-ids IDS.json] [--new-weights] [--pause-at STEP ...]
        [--abort-at-pause ID] [--abort-preempted] [--kv-blocks N] [--no-routed-experts]

The environment decides the rest (R3CACHE_URL and friends, vLLM's CPU settings). Each
round sends every prompt once; OUT.npz holds each completion's token ids and inline
routed experts by request id, and OUT.json what the r3cache connector counted. With
--request-ids each prompt goes in under the id its caller gave (vLLM's engine API, one
round, n = 1), and OUT.npz holds them by prompt index, ``#<i>`` (a caller's id may be
no file name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import numpy as np


def _model_runner(llm):
    """The model runner of an in-process engine."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


def _connector(llm):
    """The model runner's aux-output connector of an in-process engine, if reachable."""
    try:
        return _model_runner(llm).aux_output_connector
    except AttributeError:
        return None


def _update_weights(llm) -> None:
    """A weight update in place that moves the routes: every token's embedding, which
    every router's input depends on, rolled along the hidden axis and doubled."""
    import torch

    model = _model_runner(llm).model
    embeddings = [m for name, m in model.named_modules() if name.endswith("embed_tokens")]
    assert embeddings, "the model has no token embeddings to update"
    with torch.no_grad():
        for embedding in embeddings:
            embedding.weight.copy_(embedding.weight.roll(1, 1) * 2)


def _count_preemptions(llm) -> list[str]:
    """The ids of the requests vLLM's scheduler preempts from now on, one per preemption."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempt, preempted = scheduler._preempt_request, []

    def counted(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted
    return preempted


def _stepped_rollouts(llm, prompts, args, arrays, preemptions: list[str]) -> dict:
    """Step the engine through ``prompts`` with a weight update in flight before each step
    of ``args.pause_at`` (and the aborts asked for); returns the request ids in the order
    they finished, those that finished in a step right before a pause, and the request
    aborted while preempted."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=args.max_tokens + 3 * i, ignore_eos=True, temperature=0, seed=0))
    ids: list[str] = []
    just_before: list[str] = []
    aborted = None
    step = 0
    while engine.has_unfinished_requests():
        if step in args.pause_at:
            core.pause_scheduler(mode="keep", clear_cache=True)
            _update_weights(llm)
            if args.abort_at_pause and step == min(args.pause_at):
                engine.abort_request([args.abort_at_pause])
            core.resume_scheduler()
        told = len(preemptions)  # preempted before this step: its metadata tells the worker
        for output in engine.step():
            if output.finished:
                ids.append(output.request_id)
                if step + 1 in args.pause_at:
                    just_before.append(output.request_id)
                arrays[f"tokens:{output.request_id}"] = np.array(output.outputs[0].token_ids)
                arrays[f"routes:{output.request_id}"] = np.asarray(
                    output.outputs[0].routed_experts)
        if args.abort_preempted and aborted is None:
            waiting = {request.request_id for request in core.scheduler.waiting}
            aborted = next((r for r in preemptions[:told] if r in waiting), None)
            if aborted is not None:
                engine.abort_request([aborted], internal=True)
        step += 1
    # The engine core knows a request as "<caller's id>-<8 random hex>".
    return {"ids": ids, "finished_before_pause": just_before,
            "aborted": aborted and aborted.rsplit("-", 1)[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="let vLLM capture CUDA graphs (on a GPU; eager otherwise)")
    parser.add_argument("--shutdown-redis", type=int, default=None, metavar="PORT",
                        help="shut the Redis at PORT down after the first round")
    parser.add_argument("--request-ids", default=None, metavar="IDS.json",
                        help="the id each prompt is sent under")
    parser.add_argument("--new-weights", action="store_true",
                        help="between rounds, update the weights in place (the routes "
                        "change) and reset the prefix cache, as an RL loop does after a "
                        "training step")
    parser.add_argument("--pause-at", type=int, action="append", default=[], metavar="STEP",
                        help="one round, request i asking for max-tokens + 3 i tokens; "
                        "before engine step STEP, pause with the requests kept "
                        "(pause_generation(mode='keep'), which resets the prefix cache), "
                        "update the weights in place and resume: an RL loop's weight "
                        "update in flight")
    parser.add_argument("--abort-at-pause", default=None, metavar="ID",
                        help="abort request ID during the first pause, before it runs again")
    parser.add_argument("--abort-preempted", action="store_true",
                        help="one round as with --pause-at; abort the first request that "
                        "waits after a preemption the worker has heard of")
    parser.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                        help="a KV cache of N blocks, few enough that requests are "
                        "preempted and recomputed")
    parser.add_argument("--no-routed-experts", action="store_true",
                        help="without enable_return_routed_experts")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", block_size=32, max_model_len=1024,
              enable_prefix_caching=True,
              enable_return_routed_experts=not args.no_routed_experts, max_num_seqs=8,
              max_num_batched_tokens=512, enforce_eager=not args.cuda_graphs, seed=0,
              num_gpu_blocks_override=args.kv_blocks)
    preemptions = _count_preemptions(llm)
    prompts = json.loads(Path(args.prompts).read_text())
    # Greedy, except that samples of one request (n > 1) are drawn, seeded.
    params = SamplingParams(max_tokens=args.max_tokens, n=args.n, ignore_eos=True,
                            temperature=0 if args.n == 1 else 1.0, seed=0)
    arrays: dict[str, np.ndarray] = {}
    ids: list[str] = []
    if args.request_ids:
        ids = json.loads(Path(args.request_ids).read_text())
        engine = llm.llm_engine
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    key = f"#{ids.index(output.request_id)}"
                    arrays[f"tokens:{key}"] = np.array(output.outputs[0].token_ids)
                    arrays[f"routes:{key}"] = np.asarray(output.outputs[0].routed_experts)
    report = {}
    stepped = args.pause_at or args.abort_preempted
    if stepped:
        report = _stepped_rollouts(llm, prompts, args, arrays, preemptions)
        ids = report["ids"]
    for round_ in range(args.rounds if not (args.request_ids or stepped) else 0):
        if round_ and args.new_weights:
            _update_weights(llm)
            assert llm.reset_prefix_cache()
        if round_ == 1 and args.shutdown_redis:
            import redis

            # Redis answers SHUTDOWN by closing the connection.
            with contextlib.suppress(redis.exceptions.ConnectionError):
                redis.Redis(port=args.shutdown_redis).shutdown(nosave=False)
        for output in llm.generate(prompts, params, use_tqdm=False):
            for completion in output.outputs:
                key = (output.request_id if args.n == 1
                       else f"{output.request_id}/{completion.index}")
                ids.append(key)
                arrays[f"tokens:{key}"] = np.array(completion.token_ids)
                if completion.routed_experts is not None:
                    arrays[f"routes:{key}"] = np.asarray(completion.routed_experts)
    np.savez(args.out, **arrays)
    report["ids"] = ids
    connector = _connector(llm)
    worker = getattr(connector, "worker", None)
    if worker is not None:
        report["blocks_published"] = worker.stats.blocks_published
        report["blocks_read"] = worker.stats.blocks_read
        report["manifests"] = worker.stats.manifests
        report["connector"] = type(connector).__module__
        report["store_max_bytes"] = getattr(worker.store, "max_bytes", None)
        report["block_nbytes"] = worker.layout.block_nbytes
        report["hash_block_size"] = worker.layout.block_size
        report["steps_in_flight"] = worker.max_concurrent_batches
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        report["kv_cache_blocks"] = scheduler.kv_cache_config.num_blocks
    report["preemptions"] = len(preemptions)
    Path(args.out).with_suffix(".json").write_text(json.dumps(report))
    del llm


if __name__ == "__main__":
    main()
