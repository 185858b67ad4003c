"""``peagle pipeline schedule``: a recurring run of a compiled pipeline (the refresh, by default) on a
Kubeflow Pipelines / OpenShift AI pipeline server.

The trigger is a cron expression of the usual five fields (minute hour day-of-month month day-of-week,
:func:`kfp_cron`) or an interval (``90m``, ``6h``, ``1d``, ``3600s``; :func:`interval_seconds`), checked
here before anything is contacted; KFP's cron (robfig/cron) takes six fields, seconds first, so the
schedule fires at second 0. Every recurring run allows one run at a time (``max_concurrency=1``) and does
not catch up on intervals it missed while paused or behind (``no_catchup``): a refresh that runs long
delays the next one instead of stacking, and a paused schedule resumed later starts one run, not a backlog.
Caching is off, as for :func:`peagle.pipeline.submit.submit`: each scheduled run must look at the traffic
anew (a cached first step would replay an old "go/not needed").

The server is reached as ``submit`` reaches it (:func:`peagle.pipeline.submit.on_server`: host and token
from the flags or ``KF_PIPELINES_ENDPOINT``/``KF_PIPELINES_TOKEN``, the URL and a TCP connection checked,
every request bounded, the backend version >= :data:`peagle.support.MIN_KFP_BACKEND`). The experiment is
found by name or created. The token is handed to the client only, never printed.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, shorten
from .submit import SubmitError, on_server, ui_link

MIN_INTERVAL_S = 60  # KFP's scheduler works in whole minutes at best; a shorter period is a mistake
MAX_INTERVAL_S = 366 * 86400  # a loop that refreshes less than once a year is a typo, not a schedule
MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # February's 29th does come
INTERVAL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_EXPERIMENT = "Default"  # kfp.Client's own default, as `submit` uses


@dataclass(frozen=True)
class CronField:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()  # names of low, low+1, ... (robfig/cron accepts them, case-insensitive)
    blank: bool = False          # "?" allowed (robfig/cron: the day fields)

    def value(self, token: str) -> int:
        if token.isascii() and token.isdigit():
            if len(token.lstrip("0")) > 4:  # far out of any field's range (and int() stops at 4300 digits)
                raise ConfigError(f"--cron: the {self.name} field has {shorten(token, 20)!r}, out of its range "
                                  f"{self.low}-{self.high}")
            return int(token)
        if token.upper() in self.names:
            return self.low + self.names.index(token.upper())
        raise ConfigError(f"--cron: the {self.name} field has {shorten(token, 20)!r}, not a number"
                          + (f" or a name ({self.names[0]}..{self.names[-1]})" if self.names else ""))


CRON_FIELDS = (
    CronField("minute", 0, 59),
    CronField("hour", 0, 23),
    CronField("day-of-month", 1, 31, blank=True),
    CronField("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    CronField("day-of-week", 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"), blank=True),
)
_ITEM = re.compile(r"^(?P<range>\*|\?|[A-Za-z0-9]+(?:-[A-Za-z0-9]+)?)(?:/(?P<step>[^/]*))?$")


def kfp_cron(text: str) -> str:
    """The five-field cron ``text`` (``"30 2 * * MON-FRI"``) checked field by field, as KFP's six-field form
    (``"0 30 2 * * MON-FRI"``). Each field is ``*``, a value, a range ``a-b``, any of them with a step
    ``/n``, or a comma list of those; values within the field's range (day-of-week 0-6, 0 = Sunday).
    ConfigError names the field."""
    fields = text.split()
    if len(fields) != len(CRON_FIELDS):
        raise ConfigError(f"--cron takes {len(CRON_FIELDS)} fields ({' '.join(f.name for f in CRON_FIELDS)}); "
                          f"{shorten(text, 60)!r} has {len(fields)} (KFP's leading seconds field is set to 0 here)")
    selected = [set().union(*(_check_item(field, item) for item in part.split(",")))
                for field, part in zip(CRON_FIELDS, fields)]
    _check_some_day_exists(fields[2], fields[3], fields[4], selected[2], selected[3])
    return "0 " + " ".join(fields)


def _starred(field: str) -> bool:
    """robfig/cron's star bit: some comma item is ``*`` or ``?`` with no step or a step of 1."""
    for item in field.split(","):
        head, _, step = item.partition("/")
        if head in ("*", "?") and (not step or (step.isascii() and step.isdigit() and int(step) <= 1)):
            return True
    return False


def _check_some_day_exists(day_of_month: str, month: str, day_of_week: str, days: set[int],
                           months: set[int]) -> None:
    """Refuse a day-of-month that no named month has (``31 2``: February 31st), which would never fire.
    With a day-of-week set too, either day matches (robfig/cron, KFP's scheduler): nothing to refuse. A field
    counts as unset when robfig/cron gives it its star bit: an item ``*`` or ``?`` with no step or step 1
    (``*/1`` too; ``*/2`` is a set of days: ``getRange`` in robfig/cron's parser.go clears the bit for steps
    above 1, and ``dayMatches`` then ANDs the two fields). ``days``, ``months``: the values the two fields select."""
    if not _starred(day_of_week) or _starred(day_of_month):
        return
    if not any(d <= MONTH_DAYS[m - 1] for d in days for m in months):
        raise ConfigError(f"--cron: the day-of-month field {day_of_month!r} names no day of the month field's "
                          f"months {month!r}; this schedule would never run")


def _check_item(field: CronField, item: str) -> set[int]:
    """The values ``item`` (one of a field's comma list) selects; ConfigError naming the field if it is bad."""
    m = _ITEM.match(item)
    if not m:
        raise ConfigError(f"--cron: the {field.name} field has {shorten(item, 20)!r}: expected *, a value, "
                          "a range a-b, an optional /step, or a comma list of those")
    span, step = m.group("range"), m.group("step")
    if step is not None and not (step.isascii() and step.isdigit() and len(step) <= 4 and int(step) >= 1):
        raise ConfigError(f"--cron: the {field.name} field has the step {shorten(step, 20)!r}; a step is a "
                          "whole number >= 1")
    if span == "?" and not field.blank:
        raise ConfigError(f"--cron: the {field.name} field cannot be '?' (only day-of-month and day-of-week)")
    stride = int(step) if step is not None else 1
    if span in ("*", "?"):
        return set(range(field.low, field.high + 1, stride))
    values = [field.value(v) for v in span.split("-")]
    for v in values:
        if not field.low <= v <= field.high:
            raise ConfigError(f"--cron: the {field.name} field has {v}, out of its range {field.low}-{field.high}"
                              + (" (0 = Sunday)" if field.name == "day-of-week" else ""))
    if len(values) == 2 and values[0] > values[1]:
        raise ConfigError(f"--cron: the {field.name} field has the range {shorten(span, 20)!r}, which runs backwards")
    high = values[-1] if len(values) == 2 else (field.high if step is not None else values[0])  # 'a/n': a to the end
    return set(range(values[0], high + 1, stride))


def interval_seconds(text: str) -> int:
    """``90m``, ``6h``, ``1d``, ``3600s`` in seconds (at least :data:`MIN_INTERVAL_S`, at most
    :data:`MAX_INTERVAL_S`); ConfigError naming --every."""
    m = re.fullmatch(r"([0-9]+)([smhd])", text.strip())  # ASCII digits only: not '٣d'
    if not m:
        raise ConfigError(f"--every {shorten(text, 20)!r}: expected a whole number and a unit s, m, h or d "
                          "(e.g. 90m, 6h, 1d, 3600s)")
    if len(m.group(1).lstrip("0")) > 12:  # far over the maximum (and past int()'s digit limit at 4300)
        raise ConfigError(f"--every {shorten(text, 20)!r}: the interval must be at most {MAX_INTERVAL_S // 86400}d")
    seconds = int(m.group(1)) * INTERVAL_UNITS[m.group(2)]
    if seconds < MIN_INTERVAL_S:
        raise ConfigError(f"--every {shorten(text, 20)!r} is {seconds}s; the interval must be at least "
                          f"{MIN_INTERVAL_S}s")
    if seconds > MAX_INTERVAL_S:
        raise ConfigError(f"--every {shorten(text, 20)!r} is {seconds}s; the interval must be at most "
                          f"{MAX_INTERVAL_S // 86400}d")
    return seconds


@dataclass(frozen=True)
class Trigger:
    """When the recurring run starts a run: a KFP cron (six fields) or an interval in seconds."""

    cron: str | None = None
    interval_second: int | None = None

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.interval_second is None):
            raise ValueError("a trigger is a cron expression or an interval, exactly one")

    def describe(self) -> str:
        return f"cron {self.cron!r} (seconds first)" if self.cron else f"every {self.interval_second}s"


@dataclass(frozen=True)
class Scheduled:
    recurring_run_id: str
    experiment_id: str
    url: str


def schedule(package: str | os.PathLike, arguments: dict[str, Any], trigger: Trigger, *, name: str,
             experiment: str = DEFAULT_EXPERIMENT, enabled: bool = True, client: Any = None,
             host: str | None = None, token: str | None = None, namespace: str | None = None,
             verify_ssl: bool = True) -> Scheduled:
    """Create a recurring run ``name`` of the compiled ``package`` with ``arguments`` (pipeline parameters,
    already validated) in ``experiment`` (found by name or created): one run at a time, no catch-up,
    caching off; paused unless ``enabled``."""
    if not Path(package).is_file():
        raise SubmitError(f"compiled pipeline not found: {package}")

    def create(c: Any) -> tuple[Any, str]:
        experiment_id = c.create_experiment(name=experiment, namespace=namespace).experiment_id
        job = c.create_recurring_run(experiment_id, name, cron_expression=trigger.cron,
                                     interval_second=trigger.interval_second, max_concurrency=1, no_catchup=True,
                                     params=arguments, pipeline_package_path=str(package), enabled=enabled,
                                     enable_caching=False)
        return job, experiment_id

    (job, experiment_id), client = on_server(create, client=client, host=host, token=token, namespace=namespace,
                                             verify_ssl=verify_ssl)
    job_id = getattr(job, "recurring_run_id", None) or str(job)
    return Scheduled(job_id, experiment_id, ui_link(client, host, f"recurringrun/details/{job_id}") or job_id)
