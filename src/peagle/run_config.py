"""The one run configuration: every stage's section in a single typed model.

Sections live next to the code that uses them (``peagle.data.settings`` etc.) and import only
:mod:`peagle.config`; this module assembles them, so there is no import cycle.
"""
from __future__ import annotations

from pydantic import Field

from .config import DraftSettings, StrictModel, TargetSettings
from .data.regenerate import RegenerateSettings
from .data.settings import PrepareSettings


class RunConfig(StrictModel):
    """Everything one run of the system needs."""

    target: TargetSettings = Field(default_factory=TargetSettings)
    draft: DraftSettings = Field(default_factory=DraftSettings)
    regenerate: RegenerateSettings = Field(default_factory=RegenerateSettings)
    prepare: PrepareSettings = Field(default_factory=PrepareSettings)
    work_dir: str = Field("runs/local", description="where local outputs go")
