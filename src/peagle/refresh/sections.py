"""What the refresh reads of a run configuration: :class:`RefreshRunConfig`.

The refresh's functions (:mod:`.steps`, :mod:`.trigger`) take the run configuration: the sections of the
stages it runs (prepare, regenerate, extract, train, the gate), its own (``refresh``, ``trigger``) and the
rollout's loop history. :class:`RefreshRunConfig` names them as a structural type, so that the refresh sits
below the assembly and never imports it: :class:`peagle.run_config.RunConfig` is one, and ``peagle refresh``
(:mod:`peagle.commands.refresh`) and the refresh pipeline build that. This module imports only the settings
modules of those sections.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Self

from ..config import DraftSettings, TargetSettings
from ..data.settings import PrepareSettings, RegenerateSettings
from ..extract.settings import ExtractSettings
from ..rollout.settings import RolloutSettings, TriggerSettings
from ..gate.settings import GateSettings
from ..traffic.settings import RefreshSettings
from ..train.settings import TrainSettings


class RefreshRunConfig(Protocol):
    """A run configuration as the refresh reads it (:class:`peagle.run_config.RunConfig` is one).

    The steps change it only through :meth:`model_validate` of its own type (``type(cfg)``) or
    :meth:`model_copy`, so a changed configuration is still one of the caller's, validated as the caller's.
    """

    target: TargetSettings
    draft: DraftSettings  # training reads the draft's shape
    regenerate: RegenerateSettings
    prepare: PrepareSettings
    extract: ExtractSettings
    train: TrainSettings
    gate: GateSettings
    refresh: RefreshSettings
    trigger: TriggerSettings
    rollout: RolloutSettings  # rollout.history: the loop history the refresh and its trigger share
    work_dir: str

    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...

    def model_dump(self) -> dict[str, Any]: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self: ...
