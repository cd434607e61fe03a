"""The stage's table of drivers (docs/PROTOCOL.md §5, Driver restarts), in-process."""

from __future__ import annotations

import pytest

from skippy_zmq.errors import DriverReplacedError, SessionError
from skippy_zmq.stage.drivers import DriverRestart, DriverTable, describe
from skippy_zmq.wire.messages import driver_id_for, driver_word


def test_the_first_word_of_a_driver_is_no_restart_and_repeating_it_changes_nothing() -> None:
    table = DriverTable()
    assert table.see(driver_word(3, 1)) is None
    assert table.see(driver_word(3, 1)) is None
    assert table.current(3) == driver_word(3, 1)


def test_a_new_incarnation_replaces_the_old_one_which_is_refused_from_then_on() -> None:
    table = DriverTable()
    old, new, newer = driver_word(3, 1), driver_word(3, 2), driver_word(3, 3)
    table.see(old)
    assert table.see(new) == DriverRestart(3, old, new)
    with pytest.raises(DriverReplacedError, match=r"0x00030001 \(driver 3, incarnation 1\) was replaced"):
        table.see(old)
    assert table.see(newer) == DriverRestart(3, new, newer)
    for word in (old, new):  # an incarnation never comes back, however many followed it
        with pytest.raises(SessionError):
            table.check(word)
    table.check(newer)


def test_word_0_and_other_drivers_are_left_alone() -> None:
    table = DriverTable()
    table.see(driver_word(3, 1))
    assert table.see(0) is None
    assert table.see(driver_word(4, 9)) is None  # another driver: no restart of driver 3
    assert table.current(3) == driver_word(3, 1)
    table.check(0)


def test_the_table_is_bounded_in_drivers_and_in_replaced_incarnations() -> None:
    table = DriverTable(max_drivers=2, max_replaced=2)
    for incarnation in range(1, 6):
        table.see(driver_word(1, incarnation))
    table.check(driver_word(1, 2))  # forgotten: only the last 2 replaced are remembered
    with pytest.raises(DriverReplacedError):
        table.check(driver_word(1, 3))
    table.see(driver_word(2, 1))
    table.see(driver_word(3, 1))  # a third driver id: the least recently heard (1) is forgotten
    assert table.current(1) is None and table.current(2) is not None
    table.check(driver_word(1, 4))


def test_a_driver_id_is_the_same_for_the_same_return_endpoint_and_differs_for_another() -> None:
    first = driver_id_for("tcp://127.0.0.1:5555")
    assert first == driver_id_for("tcp://127.0.0.1:5555")
    assert first != driver_id_for("tcp://127.0.0.1:5556")
    assert 1 <= first <= 0x7FFF
    assert describe(driver_word(first, 0xFFFF)).endswith(f"(driver {first}, incarnation 65535)")
