"""SchedulerConnector: builds each step's StepMetadata on the scheduler side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from r3cache.checks import count
from r3cache.connector.metadata import BlockHash, RequestOutput, StepMetadata, block_key
from r3cache.errors import MetadataError
from r3cache.manifest import Completion, check_request_id


@dataclass
class _SchedulerRequest:
    prompt_start: int
    emit_start: int  # where the request's owed rows resume on (re)registration
    hashes: list[BlockHash]
    hashes_sent: int = 0
    registered: bool = False  # known to the worker; False while preempted
    kept: bool = False  # preempted on the worker, which keeps what it was given until it ends


class SchedulerConnector:
    """Own what the worker has been told: registrations, hashes sent, generation."""

    def __init__(self) -> None:
        self.generation = 0
        self._requests: dict[str, _SchedulerRequest] = {}
        self._to_register: dict[str, None] = {}
        # Requests with hashes to send; finished ones stay until their hashes went out.
        self._hash_updates: dict[str, _SchedulerRequest] = {}
        self._finished: list[str] = []
        self._preempted: list[str] = []
        self._completions: dict[str, Completion] = {}

    def add_request(
        self, req_id: str, *, prompt_start: int = 0, block_hashes: Sequence[BlockHash] = ()
    ) -> None:
        """A new request: it is owed rows from ``prompt_start`` on."""
        check_request_id(req_id)
        if req_id in self._requests:
            raise MetadataError(f"request {req_id!r} was already added")
        prompt_start = count(prompt_start, f"request {req_id!r}: prompt_start", 0,
                             MetadataError)
        hashes = _checked_hashes(req_id, block_hashes, 0)
        self._requests[req_id] = _SchedulerRequest(prompt_start, prompt_start, hashes)
        self._register(req_id)

    def update_block_hashes(self, req_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request's full list of block hashes so far; only the new suffix is sent."""
        state = self._state(req_id)
        known = len(state.hashes)
        new = _checked_hashes(req_id, block_hashes, known)
        if len(block_hashes) < known:
            raise MetadataError(f"request {req_id!r}: block hashes cannot shrink")
        # Hashes chain: the last one sent standing where it was vouches for those before.
        # Another chain's suffix would key this request's rows as its blocks.
        if known and block_hashes[known - 1] != state.hashes[-1]:
            raise MetadataError(f"request {req_id!r}: block hash {known - 1} differs from "
                                "the one sent; the list must extend the hashes sent")
        if new:
            state.hashes.extend(new)
            if state.registered:
                self._hash_updates[req_id] = state

    def record_output(self, req_id: str, output: RequestOutput) -> None:
        """Note rows delivered, so a preempted request resumes after them."""
        state = self._state(req_id)
        if not isinstance(output, RequestOutput):
            raise MetadataError(f"request {req_id!r}: record_output takes the RequestOutput "
                                f"the worker returned, not {type(output).__name__}")
        state.emit_start = max(state.emit_start, output.token_end)

    def preempt_request(self, req_id: str) -> None:
        """The worker drops the request's state, keeping what it was given (for its
        manifest); ``resume_request`` restarts it."""
        state = self._state(req_id)
        if state.registered and self._unregister(req_id, state):
            self._preempted.append(req_id)
            state.kept = True

    def resume_request(self, req_id: str) -> None:
        if req_id in self._finished:
            # The worker must see the teardown before the new registration.
            raise MetadataError(
                f"request {req_id!r} was preempted in this step; resume it in a later one"
            )
        if not self._state(req_id).registered:
            self._register(req_id)

    def finish_request(self, req_id: str, *, num_tokens: int | None = None) -> None:
        """The request ended. With ``num_tokens`` (prompt and output tokens) it finished
        for good and its routes become a manifest; without, it was aborted."""
        state = self._state(req_id)
        if num_tokens is not None:
            num_tokens = count(num_tokens, f"request {req_id!r}: num_tokens", 1, MetadataError)
            if num_tokens - 1 < state.prompt_start:
                raise MetadataError(f"request {req_id!r}: {num_tokens} tokens end before its "
                                    f"prompt_start {state.prompt_start}")
            if not (state.registered or state.kept):
                raise MetadataError(f"request {req_id!r} finished before it ran; nothing of "
                                    "it can be recorded")
            self._completions[req_id] = Completion(state.prompt_start, num_tokens)
        del self._requests[req_id]
        if not (state.registered and self._unregister(req_id, state)) and state.kept:
            self._finished.append(req_id)  # recorded from what it was given, let go

    def reset_prefix_cache(self) -> None:
        """Start a new generation: the worker releases everything but what requests were
        given (their manifests name it); live requests re-register.

        Finished requests must reach the worker first (their manifests belong to the
        old generation): build and send the pending step metadata before resetting.
        """
        if self._finished or self._completions:
            raise MetadataError(
                f"{len(self._finished)} finished request(s) not yet sent to the worker; "
                "send the step metadata before resetting the prefix cache"
            )
        self.generation += 1
        self._hash_updates.clear()
        for req_id, state in self._requests.items():
            if state.registered:
                state.registered = False
                self._register(req_id)

    def build_step_metadata(self) -> StepMetadata:
        """Everything the worker has not been told yet; call once per scheduler step."""
        requests = {rid: self._requests[rid].emit_start for rid in self._to_register}
        hashes = {}
        for rid, state in self._hash_updates.items():
            hashes[rid] = state.hashes[state.hashes_sent :]
            state.hashes_sent = len(state.hashes)
        metadata = StepMetadata(self.generation, requests, hashes, tuple(self._finished),
                                dict(self._completions), preempted=tuple(self._preempted))
        self._to_register.clear()
        self._hash_updates.clear()
        self._finished.clear()
        self._preempted.clear()
        self._completions.clear()
        return metadata

    def _register(self, req_id: str) -> None:
        state = self._requests[req_id]
        state.registered = True
        state.hashes_sent = 0
        self._to_register[req_id] = None
        if state.hashes:
            self._hash_updates[req_id] = state

    def _unregister(self, req_id: str, state: _SchedulerRequest) -> bool:
        """Tear the request down on the worker; whether it had reached it."""
        state.registered = False
        if self._to_register.pop(req_id, 0) is None:
            # Never reached the worker: nothing to tear down there.
            self._hash_updates.pop(req_id, None)
            if not state.kept:  # (a kept one is recorded from what it was given)
                self._completions.pop(req_id, None)
            return False
        # Unsent hashes still go out with the teardown: the KV prefix cache keeps
        # those blocks, so the worker must publish their rows before releasing them.
        self._finished.append(req_id)
        return True

    def _state(self, req_id: str) -> _SchedulerRequest:
        try:
            return self._requests[req_id]
        except KeyError:
            raise MetadataError(
                f"request {req_id!r} is not known to the scheduler connector"
            ) from None


def _checked_hashes(req_id: str, block_hashes: Sequence[BlockHash], known: int
                    ) -> list[BlockHash]:
    """The hashes of ``block_hashes`` from ``known`` on, each checked as the worker will
    key it (block_key): refused here, before the scheduler counts them as sent, a bad hash
    is not lost in a step the worker refuses. A str or bytes is one hash, not a list."""
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise MetadataError(f"request {req_id!r}: block hashes are a list, not "
                            f"{type(block_hashes).__name__}")
    new = list(block_hashes[known:])
    for block_hash in new:
        block_key(block_hash)
    return new
