"""Pure-logic pieces of the frontend: confirm tracking, delivery tags, per-channel ordering."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.amqp.errors import AMQPChannelError
from frontend.amqp.backlog import Backlog
from frontend.amqp.delivery_tags import DeliveryTags, group_by_shard
from frontend.amqp.replies import error_from_reply, reply_text
from frontend.confirms import ConfirmTracker

# ------------------------------------------------------------------ confirms


def test_in_order_confirms_collapse_into_one_multiple_ack():
    t = ConfirmTracker()
    seqs = [t.publish(1) for _ in range(5)]
    assert seqs == [1, 2, 3, 4, 5]
    t.confirm([1, 2, 3, 4, 5])
    assert t.drain() == [(5, True, True)]
    assert t.drain() == []
    assert t.unconfirmed == 0


def test_single_settled_message_is_a_single_ack():
    t = ConfirmTracker()
    t.publish(1)
    t.confirm([1])
    assert t.drain() == [(1, False, True)]


def test_out_of_order_settlement_acks_prefix_then_singles():
    t = ConfirmTracker()
    for _ in range(6):
        t.publish(1)
    t.confirm([1, 2, 4, 6])  # 3 and 5 still pending
    assert t.drain() == [(2, True, True), (4, False, True), (6, False, True)]
    t.confirm([3])
    # 3 closes the gap: everything up to 4 is settled; 4 was already sent, re-covering it is harmless
    assert t.drain() == [(3, False, True)]
    t.confirm([5])
    assert t.drain() == [(5, False, True)]


def test_message_routed_to_two_shards_needs_both_confirms():
    t = ConfirmTracker()
    t.publish(2)
    t.confirm([1])
    assert t.drain() == []
    t.confirm([1])
    assert t.drain() == [(1, False, True)]


def test_one_nack_from_any_shard_nacks_the_message():
    t = ConfirmTracker()
    t.publish(2)
    t.publish(1)
    t.confirm([1], ok=False)
    t.confirm([2])
    assert t.drain() == [(2, False, True)]
    t.confirm([1])
    assert t.drain() == [(1, False, False)]


def test_nacks_go_out_before_the_multiple_ack_that_passes_them():
    t = ConfirmTracker()
    for _ in range(3):
        t.publish(1)
    t.confirm([1, 3])
    t.confirm([2], ok=False)
    assert t.drain() == [(2, False, False), (3, True, True)]


def test_unroutable_publish_is_acked_at_once():
    t = ConfirmTracker()
    t.publish(1)
    t.publish(0)
    assert t.drain() == [(2, False, True)]
    t.confirm([1])
    assert t.drain() == [(1, False, True)]


def test_unknown_and_duplicate_confirms_are_ignored():
    t = ConfirmTracker()
    t.publish(1)
    t.confirm([1, 1, 99])
    assert t.drain() == [(1, False, True)]


def test_fail_all_nacks_everything_pending():
    t = ConfirmTracker()
    for _ in range(3):
        t.publish(1)
    t.confirm([2])
    t.fail_all()
    out = t.drain()
    assert sorted((tag, ack) for tag, _m, ack in out) == [(1, False), (2, True), (3, False)]


@given(st.lists(st.integers(1, 3), min_size=1, max_size=40), st.randoms())
def test_every_publish_is_answered_exactly_once(fanouts, rnd):
    """Simulate a client's view: multiple acks cover all outstanding tags <= N."""
    t = ConfirmTracker()
    pending_shards = {}
    for n in fanouts:
        seq = t.publish(n)
        pending_shards[seq] = n
    answers = [seq for seq, n in pending_shards.items() for _ in range(n)]
    rnd.shuffle(answers)
    outstanding = set(pending_shards)
    answered: dict[int, bool] = {}
    while answers:
        batch = [answers.pop(0) for _ in range(min(len(answers), rnd.randint(1, 5)))]
        t.confirm(batch)
        for tag, multiple, ack in t.drain():
            covered = [s for s in outstanding if (s <= tag if multiple else s == tag)]
            # a single frame answers exactly one outstanding tag; a multiple one at least one
            assert covered and (multiple or tag in outstanding)
            for s in covered:
                answered[s] = ack
                outstanding.discard(s)
    assert not outstanding
    assert all(answered.values())
    assert set(answered) == set(pending_shards)


@given(st.lists(st.one_of(st.tuples(st.just("publish"), st.integers(0, 2)),
                          st.tuples(st.just("confirm"), st.integers(0, 12), st.booleans()),
                          st.tuples(st.just("fail_all")), st.tuples(st.just("drain"))), max_size=60))
def test_drain_fast_path_answers_as_the_general_one(ops):
    """drain's shortcut (one settled, nothing pending) gives what the general _drain gives for the
    same state: the same frames, the same low cursor and acked count."""
    t = ConfirmTracker()
    for op in ops:
        if op[0] == "publish":
            t.publish(op[1])
        elif op[0] == "confirm":
            t.confirm([op[1]], ok=op[2])
        elif op[0] == "fail_all":
            t.fail_all()
        else:
            ref = copy.deepcopy(t)
            settled, ref._settled = ref._settled, []
            expected = ref._drain(settled) if settled else []
            assert t.drain() == expected
            assert (t._low, t.n_acked, t._settled) == (ref._low, ref.n_acked, [])


def test_drain_fast_path_is_taken_for_one_message_in_flight():
    t = ConfirmTracker()
    for seq in range(1, 4):
        assert t.publish(1) == seq
        t.confirm([seq], ok=seq != 2)
        assert t._remaining == {} and len(t._settled) == 1
        assert t.drain() == [(seq, False, seq != 2)]
        assert t._low == seq + 1
    assert t.n_acked == 2


# -------------------------------------------------------------- delivery tags


def test_tags_are_consecutive_and_remembered_except_no_ack():
    tags = DeliveryTags()
    assert tags.add(0, 7, 100) == 1
    assert tags.skip() == 2
    assert tags.add(1, 8, 200) == 3
    assert len(tags) == 2
    assert tags.take(3, False) == [(1, 8, 200)]
    assert tags.take(1, False) == [(0, 7, 100)]


def test_multiple_ack_takes_all_tags_up_to_n():
    tags = DeliveryTags()
    for i in range(1, 6):
        tags.add(i % 2, 1, i)
    assert tags.take(3, True) == [(1, 1, 1), (0, 1, 2), (1, 1, 3)]
    assert sorted(tags.unacked) == [4, 5]


def test_multiple_with_tag_zero_takes_everything():
    tags = DeliveryTags()
    for i in range(3):
        tags.add(0, 1, i)
    assert len(tags.take(0, True)) == 3
    assert len(tags) == 0


def test_unknown_tag_is_a_406_channel_error():
    tags = DeliveryTags()
    tags.add(0, 1, 1)
    tags.take(1, False)
    with pytest.raises(AMQPChannelError) as err:
        tags.take(1, False)
    assert err.value.code == 406 and err.value.text == "unknown delivery tag 1"
    with pytest.raises(AMQPChannelError):
        tags.take(0, False)
    tags.add(0, 1, 2)
    with pytest.raises(AMQPChannelError):
        tags.take(5, True)  # RabbitMQ: the tag itself must be outstanding
    assert len(tags) == 1


def test_group_by_shard_flattens_queue_and_message_ids():
    refs = [(0, 1, 10), (1, 2, 20), (0, 3, 30)]
    assert group_by_shard(refs) == {0: [1, 10, 3, 30], 1: [2, 20]}


# ----------------------------------------------------------- channel backlog


def test_backlog_holds_events_while_busy_and_keeps_order():
    seen = []
    backlog = Backlog(seen.append)
    backlog.submit("declare")
    backlog.block()  # declare sent a request
    backlog.submit("publish-1")
    backlog.submit("publish-2")
    assert seen == ["declare"]
    backlog.unblock()
    assert seen == ["declare", "publish-1", "publish-2"]
    assert len(backlog) == 0


def test_backlog_stops_draining_when_a_waiting_event_blocks_again():
    seen = []

    def handle(ev):
        seen.append(ev)
        if ev.startswith("bind"):
            backlog.block()

    backlog = Backlog(handle)
    backlog.submit("bind-1")
    backlog.submit("publish-1")
    backlog.submit("bind-2")
    backlog.submit("publish-2")
    assert seen == ["bind-1"]
    backlog.unblock()
    assert seen == ["bind-1", "publish-1", "bind-2"]
    backlog.submit("publish-3")
    backlog.unblock()
    assert seen == ["bind-1", "publish-1", "bind-2", "publish-2", "publish-3"]


def test_backlog_clear_drops_waiting_events():
    seen = []
    backlog = Backlog(seen.append)
    backlog.block()
    backlog.submit("a")
    backlog.clear()
    backlog.submit("b")
    assert seen == ["b"]


# ------------------------------------------------------------------ replies


def test_reply_text_adds_rabbitmq_prefix_once():
    assert reply_text(404, "no queue 'q' in vhost '/'") == "NOT_FOUND - no queue 'q' in vhost '/'"
    assert reply_text(404, "NOT_FOUND - no queue 'q'") == "NOT_FOUND - no queue 'q'"


def test_error_from_reply_picks_level_by_code():
    assert type(error_from_reply([404, "x", 50, 10], 0, 0)).__name__ == "AMQPChannelError"
    exc = error_from_reply([530, "y", 0, 0], 60, 20)
    assert type(exc).__name__ == "AMQPConnectionError" and (exc.class_id, exc.method_id) == (60, 20)
    assert error_from_reply("garbage", 1, 2).code == 541


def test_shard_paces_publishers_for_a_consumer_at_its_prefetch_limit_not_only_out_of_credit():
    """shard.worker._consumer_waiting: the condition (besides a backlog) under which a shard holds
    PROCESSED answers so that publishers slow down to what consumers take."""
    from shard.consumers import ChannelRef, Consumer
    from shard.worker import _consumer_waiting

    chan = ChannelRef(b"fe-0", 1, 1)
    c = Consumer(chan, "t", no_ack=False, exclusive=False, prefetch=10, arguments={})
    assert not _consumer_waiting([c])  # room under its prefetch, credit left
    c.unacked = 10
    assert _consumer_waiting([c])  # at its prefetch limit: waits for its own acks
    c.unacked, c.credit = 0, 0
    assert _consumer_waiting([c])  # out of credit
    c.credit, c.unacked, c.active = 5, 10, False
    assert not _consumer_waiting([c])  # an idle single-active-consumer standby waits for nothing
    free = Consumer(chan, "u", no_ack=True, exclusive=False, prefetch=0, arguments={})
    assert not _consumer_waiting([free])
