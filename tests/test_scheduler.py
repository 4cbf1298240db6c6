import pytest

from r3cache import RequestOutput, SchedulerConnector
from r3cache.errors import MetadataError
from r3cache.layout import RoutingLayout

ROWS = RoutingLayout(2, 1, 4, 4).empty_rows(5)


def test_new_requests_carry_their_emit_start_and_hashes_are_sent_once():
    s = SchedulerConnector()
    s.add_request("a", prompt_start=3, block_hashes=[b"h0", b"h1"])
    md = s.build_step_metadata()
    assert dict(md.requests) == {"a": 3}
    assert {k: list(v) for k, v in md.block_hashes.items()} == {"a": [b"h0", b"h1"]}
    s.update_block_hashes("a", [b"h0", b"h1", b"h2"])
    md = s.build_step_metadata()
    assert dict(md.requests) == {}
    assert {k: list(v) for k, v in md.block_hashes.items()} == {"a": [b"h2"]}
    assert s.build_step_metadata().is_empty()
    with pytest.raises(MetadataError, match="cannot shrink"):
        s.update_block_hashes("a", [b"h0"])
    # Another chain: its new hash would key a's rows as that chain's block.
    with pytest.raises(MetadataError, match="block hash 2 differs"):
        s.update_block_hashes("a", [b"x0", b"x1", b"x2", b"x3"])
    assert s.build_step_metadata().is_empty()
    for bad in (None, "h0h1h2h3", b"h0h1h2h3"):  # no list: refused by name, not by len()
        with pytest.raises(MetadataError, match="block hashes are a list"):
            s.update_block_hashes("a", bad)


def test_finishing_sends_unsent_hashes_with_the_teardown():
    s = SchedulerConnector()
    s.add_request("a")
    s.build_step_metadata()
    s.update_block_hashes("a", [b"h0"])
    s.finish_request("a")
    md = s.build_step_metadata()
    assert list(md.finished_requests) == ["a"] and list(md.block_hashes["a"]) == [b"h0"]
    with pytest.raises(MetadataError):
        s.finish_request("a")


def test_a_request_finished_before_the_worker_heard_of_it_sends_nothing():
    s = SchedulerConnector()
    s.add_request("a", block_hashes=[b"h0"])
    s.finish_request("a")
    assert s.build_step_metadata().is_empty()


def test_preempted_requests_resume_after_the_rows_they_received_with_all_hashes():
    s = SchedulerConnector()
    s.add_request("a", block_hashes=[b"h0", b"h1"])
    s.build_step_metadata()
    s.record_output("a", RequestOutput(0, ROWS))
    s.preempt_request("a")
    with pytest.raises(MetadataError, match="later one"):
        s.resume_request("a")
    assert list(s.build_step_metadata().finished_requests) == ["a"]
    s.resume_request("a")
    md = s.build_step_metadata()
    assert dict(md.requests) == {"a": 5} and list(md.block_hashes["a"]) == [b"h0", b"h1"]


def test_a_prefix_cache_reset_bumps_the_generation_and_reregisters_live_requests():
    s = SchedulerConnector()
    s.add_request("a", block_hashes=[b"h0"])
    s.build_step_metadata()
    s.record_output("a", RequestOutput(0, ROWS))
    s.reset_prefix_cache()
    md = s.build_step_metadata()
    assert md.generation == 1 and dict(md.requests) == {"a": 5}
    assert list(md.block_hashes["a"]) == [b"h0"]


def test_a_reset_waits_for_pending_finishes_to_reach_the_worker():
    s = SchedulerConnector()
    s.add_request("a")
    s.build_step_metadata()
    s.finish_request("a", num_tokens=5)
    with pytest.raises(MetadataError, match="send the step metadata"):
        s.reset_prefix_cache()
    md = s.build_step_metadata()
    assert dict(md.completions) == {"a": (0, 5)}
    s.reset_prefix_cache()
    assert s.build_step_metadata().generation == 1


def test_completions_need_a_registered_request_and_a_sane_token_count():
    s = SchedulerConnector()
    s.add_request("a", prompt_start=4)
    s.build_step_metadata()
    with pytest.raises(MetadataError, match="end before its prompt_start"):
        s.finish_request("a", num_tokens=4)
    s.preempt_request("a")
    assert s.build_step_metadata().preempted == ("a",)
    # Ended while preempted: the worker records it from the rows it was given.
    s.finish_request("a", num_tokens=9)
    md = s.build_step_metadata()
    assert md.finished_requests == ("a",) and dict(md.completions) == {"a": (4, 9)}
    assert md.preempted == ()
    s.add_request("b")
    s.preempt_request("b")  # before the worker heard of it: it has nothing of it
    with pytest.raises(MetadataError, match="before it ran"):
        s.finish_request("b", num_tokens=3)
