"""The request API's per-client send queues and their byte budget (socket-free, docs/PROTOCOL.md §8.1)."""

from __future__ import annotations

import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.zmq_outbox import CUT_OFF_REMEMBERED, Offer, Outbox, SendBudget

A, B = b"client-a", b"client-b"


def _drain(outbox: Outbox, identity: bytes, now: float = 0.0) -> list[bytes]:
    """Every held frame, as libzmq would take them, oldest first."""
    taken = []
    while (data := outbox.next_frame(identity)) is not None:
        taken.append(data)
        outbox.took(identity, now)
    return taken


def test_frames_leave_in_order_and_stay_counted_for_libzmqs_queue() -> None:
    outbox = Outbox(SendBudget(max_bytes=1000, zmq_frames=2))
    for data in (b"a" * 10, b"b" * 20, b"c" * 30, b"d" * 40):
        assert outbox.offer(A, data, 0.0) is Offer.QUEUED
    assert outbox.queued(A) == 100
    assert _drain(outbox, A) == [b"a" * 10, b"b" * 20, b"c" * 30, b"d" * 40]
    # libzmq holds at most 2 frames plus the one it writes: the last 3 taken (20 + 30 + 40) still count
    assert outbox.queued(A) == 90
    assert outbox.backlogged() == []


def test_a_client_over_its_byte_budget_is_cut_off_and_others_are_not() -> None:
    outbox = Outbox(SendBudget(max_bytes=100, zmq_frames=4))
    assert outbox.offer(B, b"b" * 60, 0.0) is Offer.QUEUED
    for _ in range(5):
        assert outbox.offer(A, b"a" * 20, 0.0) is Offer.QUEUED
    assert outbox.queued(A) == 100  # exactly the budget fits
    assert outbox.offer(A, b"a", 0.0) is Offer.CUT_OFF
    assert (outbox.is_cut_off(A), outbox.queued(A), outbox.next_frame(A), outbox.cut_offs) == (True, 0, None, 1)
    assert outbox.offer(A, b"a", 1.0) is Offer.DROPPED  # now and later
    assert outbox.cut_offs == 1
    assert not outbox.is_cut_off(B)
    assert outbox.offer(B, b"b" * 40, 0.0) is Offer.QUEUED
    assert outbox.peak_bytes == 100


def test_frames_libzmq_took_count_against_the_budget_until_it_holds_no_more_of_them() -> None:
    outbox = Outbox(SendBudget(max_bytes=100, zmq_frames=1))
    for _ in range(3):
        assert outbox.offer(A, b"x" * 30, 0.0) is Offer.QUEUED
        _drain(outbox, A)
    assert outbox.queued(A) == 60  # libzmq's queue of 1 plus the frame it writes; the first one is gone
    assert outbox.offer(A, b"x" * 41, 0.0) is Offer.CUT_OFF


def test_the_queue_is_bounded_in_frames_too() -> None:
    outbox = Outbox(SendBudget(max_bytes=1 << 20, max_frames=3))
    for _ in range(3):
        assert outbox.offer(A, b"", 0.0) is Offer.QUEUED
    assert outbox.offer(A, b"", 0.0) is Offer.CUT_OFF


def test_a_frame_larger_than_the_budget_cuts_its_client_off() -> None:
    outbox = Outbox(SendBudget(max_bytes=10))
    assert outbox.offer(A, b"x" * 11, 0.0) is Offer.CUT_OFF


def test_a_queue_libzmq_takes_nothing_from_stalls() -> None:
    outbox = Outbox(SendBudget(stall_s=5.0, zmq_frames=1))
    outbox.offer(A, b"a", 0.0)
    outbox.offer(A, b"a", 3.0)  # a growing queue is not progress
    outbox.offer(B, b"b", 0.0)
    outbox.took(B, 4.0)
    outbox.offer(B, b"b", 4.0)
    assert outbox.stalled(5.0) == []
    assert outbox.stalled(5.1) == [A]
    outbox.took(A, 6.0)  # progress restarts the count
    assert outbox.stalled(10.5) == [B]
    assert outbox.stalled(11.1) == [A, B]


def test_an_emptied_queue_offered_anew_is_not_stalled() -> None:
    outbox = Outbox(SendBudget(stall_s=5.0))
    outbox.offer(A, b"a", 0.0)
    _drain(outbox, A, 0.0)
    outbox.offer(A, b"a", 100.0)
    assert outbox.stalled(104.0) == []


def test_idle_clients_are_forgotten_and_gone_ones_at_once() -> None:
    outbox = Outbox(SendBudget(stall_s=5.0))
    outbox.offer(A, b"a" * 10, 0.0)
    _drain(outbox, A, 1.0)
    outbox.offer(B, b"b" * 10, 0.0)  # held: not idle, it stalls instead
    outbox.expire(6.1)
    assert (outbox.queued(A), outbox.queued(B)) == (0, 10)
    outbox.forget(B)
    assert (outbox.queued(B), outbox.backlogged(), outbox.is_cut_off(B)) == (0, [], False)


def test_cut_off_clients_are_remembered_up_to_a_bound() -> None:
    outbox = Outbox()
    for index in range(CUT_OFF_REMEMBERED + 1):
        outbox.cut_off(index.to_bytes(4, "big"))
    outbox.cut_off((1).to_bytes(4, "big"))  # again: counted once, remembered as the newest
    assert outbox.cut_offs == CUT_OFF_REMEMBERED + 1
    assert not outbox.is_cut_off((0).to_bytes(4, "big"))  # the oldest was forgotten
    assert outbox.is_cut_off((1).to_bytes(4, "big"))
    assert outbox.is_cut_off(CUT_OFF_REMEMBERED.to_bytes(4, "big"))


@pytest.mark.parametrize("field", ["max_bytes", "max_frames", "stall_s", "zmq_frames"])
def test_budget_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=f"send budget: {field} must be positive, got 0"):
        SendBudget(**{field: 0})
