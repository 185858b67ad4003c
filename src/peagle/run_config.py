"""The one run configuration: every stage's section in a single typed model.

Sections live next to the code that uses them (``peagle.data.settings`` etc.) and import only
:mod:`peagle.config`; this module assembles them, so there is no import cycle.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from .config import ConfigError, DraftSettings, StrictModel, TargetSettings
from .data.settings import PrepareSettings, RegenerateSettings
from .evaluate.settings import EvaluateSettings
from .extract.settings import ExtractSettings
from .rollout.settings import RolloutSettings, TriggerSettings
from .gate.settings import GateSettings
from .traffic.settings import RefreshSettings
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
    refresh: RefreshSettings = Field(default_factory=RefreshSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    trigger: TriggerSettings = Field(default_factory=TriggerSettings)
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
    def _regenerate_what_prepare_keeps(self) -> "RunConfig":
        # Regenerating more conversations than prepare keeps rows is wasted target time; so unset, the cap
        # follows prepare.max_samples. Set, it changes nothing else (one conversation may give several rows).
        if self.regenerate.max_conversations is None and self.prepare.max_samples is not None:
            self.regenerate.max_conversations = self.prepare.max_samples
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


def check_trainer_order(config: RunConfig, *, trainer_beside_extract: bool, runner: str) -> None:
    """Refuse what the order of training and extraction (``profile.train_beside_extract`` of the cluster
    profile; ``runner`` names where it runs) cannot run; the one place both pipeline paths check it.

    * Training beside the extraction reads each shard set as it is published: only the streaming trainer
      does; a stored-data trainer would find no complete extraction and fail at its start.
    * ``extract.max_sets_ahead`` makes the extract workers wait for the streaming trainer; where training
      starts only once every worker has ended, they would wait until their timeout.
    """
    mode, n = config.train.data_mode, config.extract.max_sets_ahead
    if trainer_beside_extract and mode != "streaming":
        raise ConfigError(f"profile.train_beside_extract=true starts training beside the extraction, but "
                          f"train.data_mode={mode} trains on a complete extraction only: set "
                          f"train.data_mode=streaming, or use a profile without train_beside_extract ({runner})")
    if n is not None and not trainer_beside_extract:
        raise ConfigError(f"extract.max_sets_ahead={n} makes the extract workers wait for the streaming trainer, but "
                          f"{runner} starts training only after every worker has finished "
                          "(profile.train_beside_extract=false): they would wait for ever. Unset "
                          "extract.max_sets_ahead (the trainer still deletes the sets it consumed)")
