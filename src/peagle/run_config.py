"""The one run configuration: every stage's section in a single typed model.

Sections live next to the code that uses them (``peagle.data.settings`` etc.) and import only
:mod:`peagle.config`; this module assembles them, so there is no import cycle.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from .config import ConfigError, DraftSettings, StrictModel, TargetSettings
from .data.regenerate import RegenerateSettings
from .data.settings import PrepareSettings
from .evaluate.settings import EvaluateSettings
from .extract.settings import ExtractSettings
from .train.settings import TrainSettings


class RunConfig(StrictModel):
    """Everything one run of the system needs."""

    target: TargetSettings = Field(default_factory=TargetSettings)
    draft: DraftSettings = Field(default_factory=DraftSettings)
    regenerate: RegenerateSettings = Field(default_factory=RegenerateSettings)
    prepare: PrepareSettings = Field(default_factory=PrepareSettings)
    extract: ExtractSettings = Field(default_factory=ExtractSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings)
    work_dir: str = Field("runs/local", description="where local outputs go")

    @model_validator(mode="after")
    def _one_set_of_aux_layers(self) -> "RunConfig":
        # The draft must read exactly the layers that were extracted; set them once (either place).
        d, e = self.draft.aux_layer_ids, self.extract.aux_layer_ids
        if d is not None and e is not None and list(d) != list(e):
            raise ValueError(f"draft.aux_layer_ids {d} differs from extract.aux_layer_ids {e}; set one of them")
        if e is None and d is not None:
            self.extract.aux_layer_ids = list(d)
        elif d is None and e is not None:
            self.draft.aux_layer_ids = list(e)
        return self

    @model_validator(mode="after")
    def _back_pressure_needs_a_deleting_trainer(self) -> "RunConfig":
        # The workers wait for a trainer that deletes what it consumed; with no such trainer they never go on.
        n, t = self.extract.max_sets_ahead, self.train
        if n is not None and not (t.data_mode == "streaming" and t.stream.delete_consumed):
            missing = "train.data_mode=streaming" if t.data_mode != "streaming" else "train.stream.delete_consumed=true"
            raise ValueError(f"extract.max_sets_ahead={n} needs {missing} (the workers wait for a trainer deleting "
                             "consumed sets): set it or unset extract.max_sets_ahead")
        return self


def check_trainer_order(extract: ExtractSettings, *, trainer_beside_extract: bool, runner: str) -> None:
    """Refuse ``extract.max_sets_ahead`` where training starts only once every extract worker has ended
    (``runner`` names where): those workers would wait for a trainer that cannot start before them."""
    n = extract.max_sets_ahead
    if n is not None and not trainer_beside_extract:
        raise ConfigError(f"extract.max_sets_ahead={n} makes the extract workers wait for the streaming trainer, but "
                          f"{runner} starts training only after every worker has finished: they would wait for "
                          "ever. Unset extract.max_sets_ahead (the trainer still deletes the sets it consumed)")
