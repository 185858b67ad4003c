"""Speed per load and the speculation schedule chosen from it.

* :mod:`.loads`    -- the load ladder on a live engine (inside the vLLM child): requests kept c at a time
* :mod:`.table`    -- the speed table: throughput, TPOT, TTFT, latency per configuration and load, ratios
  to the target alone with bootstrap intervals
* :mod:`.schedule` -- :class:`SpeculationSchedule` (``schedule.json``): K per batch-size range, chosen from
  the table, as vLLM's ``num_speculative_tokens_per_batch_size``
* :mod:`.settings` -- ``evaluate.speed``
"""
from __future__ import annotations

from .errors import ScheduleError
from .schedule import SCHEDULE_FILE, MeasuredLoad, ScheduleRange, SpeculationSchedule, choose_schedule, with_served
from .settings import SpeedSettings
from .table import SCHEDULE, TARGET, LoadPoint, Ratio, RequestTiming, SpeedTable, build_table, k_label, timings_of

__all__ = ["SCHEDULE", "SCHEDULE_FILE", "TARGET", "LoadPoint", "MeasuredLoad", "Ratio", "RequestTiming",
           "ScheduleError", "ScheduleRange", "SpeculationSchedule", "SpeedSettings", "SpeedTable", "build_table",
           "choose_schedule", "k_label", "timings_of", "with_served"]
