"""driver/settings.py: `SchedulerSettings`, its defaults, its validators and their messages, and the
settings `serve` and `generate` build once from their options."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

from skippy_zmq import defaults
from skippy_zmq.driver.generate import GenerateOptions
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.options import ServeOptions


def test_the_defaults_are_a_batch_runs() -> None:
    assert SchedulerSettings() == SchedulerSettings(
        max_queue=256, request_timeout_s=600.0, prefill_chunk=256, micro_batches=1, reply_timeout_s=120.0,
        silence_s=15.0, recovery_timeout_s=60.0, gather_max_s=0.0, cache_prompts=False)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_queue", -1, "max_queue -1 must be an integer of at least 0 (requests waiting for a lane)"),
    ("max_queue", 2.0, "max_queue 2.0 must be an integer of at least 0 (requests waiting for a lane)"),
    ("prefill_chunk", 0, "prefill_chunk 0 must be an integer of at least 1 (prompt tokens per prefill message)"),
    ("micro_batches", 0, "micro_batches 0 must be an integer of at least 1 (groups the live sessions are split into)"),
    ("micro_batches", True, "micro_batches True must be an integer of at least 1"),
    ("request_timeout_s", 0.0, "request_timeout_s 0.0 must be a number of seconds > 0"),
    ("reply_timeout_s", -1.0, "reply_timeout_s -1.0 must be a number of seconds > 0"),
    ("silence_s", math.nan, "silence_s nan must be a number of seconds > 0"),
    ("silence_s", "15", "silence_s '15' must be a number of seconds > 0"),
    ("recovery_timeout_s", -0.5, "recovery_timeout_s -0.5 must be a number of seconds >= 0"),
    ("gather_max_s", 2.0, "gather_max_s 2.0 must be a number of seconds between 0 and 1"),
    ("gather_max_s", -0.01, "gather_max_s -0.01 must be a number of seconds between 0 and 1"),
    ("cache_prompts", 1, "cache_prompts 1 must be true or false"),
])
def test_a_bad_value_is_refused_naming_the_field_the_value_and_what_was_expected(field: str, value: Any,
                                                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=r"^scheduler settings: " + re.escape(message)):
        SchedulerSettings(**{field: value})


def test_edges_that_mean_something_are_taken() -> None:
    settings = SchedulerSettings(max_queue=0, recovery_timeout_s=0, gather_max_s=1, request_timeout_s=math.inf)
    assert (settings.max_queue, settings.recovery_timeout_s, settings.gather_max_s) == (0, 0, 1)
    assert SchedulerSettings(recovery_timeout_s=math.inf).recovery_timeout_s == math.inf  # wait for ever


def test_serve_builds_its_settings_once_from_its_options_with_the_gather_window_on() -> None:
    options = ServeOptions(max_queue=3, request_timeout_s=9.5, prefill_chunk=8, micro_batches=2,
                           recovery_timeout_s=0.0, cache_prompt=False)
    expected = SchedulerSettings(max_queue=3, request_timeout_s=9.5, prefill_chunk=8, micro_batches=2,
                                 recovery_timeout_s=0.0, gather_max_s=defaults.GATHER_MAX_S, cache_prompts=False)
    assert options.scheduler == SchedulerSettings.from_serve(options) == expected
    # serve's defaults: the prompt cache on, replies and silence as a batch run's
    assert ServeOptions().scheduler == attrs.evolve(SchedulerSettings(), gather_max_s=defaults.GATHER_MAX_S,
                                                    cache_prompts=True)


def test_from_serve_reads_any_options_of_serves_shape() -> None:
    options = SimpleNamespace(max_queue=1, request_timeout_s=2.0, prefill_chunk=3, micro_batches=4,
                              recovery_timeout_s=5.0, cache_prompt=True, draft_max=6)
    assert SchedulerSettings.from_serve(options) == SchedulerSettings(
        max_queue=1, request_timeout_s=2.0, prefill_chunk=3, micro_batches=4, recovery_timeout_s=5.0,
        gather_max_s=defaults.GATHER_MAX_S, cache_prompts=True, draft_max=6)


@pytest.mark.parametrize(("value", "message"), [
    (33, "draft_max 33 must be an integer from 0 to 32 (drafts a decode step carries)"),
    (-1, "draft_max -1 must be an integer from 0 to 32"),
    (True, "draft_max True must be an integer from 0 to 32"),
])
def test_a_draft_count_outside_the_wire_limit_is_refused(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^scheduler settings: {re.escape(message)}"):
        SchedulerSettings(draft_max=value)  # type: ignore[arg-type]


def test_a_bad_serve_option_fails_when_the_options_are_made() -> None:
    with pytest.raises(ConfigError, match=r"^scheduler settings: prefill_chunk 0 must be an integer of at least 1"):
        ServeOptions(prefill_chunk=0)


def test_generate_builds_its_settings_from_its_options() -> None:
    options = GenerateOptions(prompts=("hi",), prefill_chunk=16, timeout_s=30.0, recovery_timeout_s=5.0, draft_max=4)
    assert options.scheduler == SchedulerSettings(prefill_chunk=16, reply_timeout_s=30.0, recovery_timeout_s=5.0,
                                                  draft_max=4)
    assert GenerateOptions(prompts=("hi",)).scheduler == SchedulerSettings()
    # a local pipeline has no one to restart its stages: its copy of the options waits for none
    assert attrs.evolve(options, recovery_timeout_s=0.0).scheduler.recovery_timeout_s == 0.0
