"""Checkpoint-store checks shared by the file-store (tests/unit/train/test_train_damaged.py) and the S3
(tests/integration/s3/test_train_damaged_s3.py) tests."""
from __future__ import annotations

from peagle.storage import PrefixWriter
from peagle.train.checkpoint import plan_resume, step_prefix


def fake_checkpoint(store, step: int, commit: bool = True) -> None:
    """A checkpoint prefix of two small files at ``step``; published (``_SUCCESS``) if ``commit``."""
    w = PrefixWriter(store, step_prefix(step))
    w.put_bytes("trainer_state.json", b'{"step": %d}' % step)
    w.put_bytes("model.safetensors", bytes(64))
    if commit:
        w.commit({"step": step})


def check_plan_resume_tells_damaged_from_crashed(store) -> None:
    """plan_resume on ``store`` (any Store): a prefix without _SUCCESS is ignored (crashed mid-publish);
    a complete one whose files fail verification is damaged: ``fail`` names the file, ``previous`` falls
    back, and the damaged steps are reported even with resume=false."""
    for step in (2, 4, 6):
        fake_checkpoint(store, step)
    fake_checkpoint(store, 8, commit=False)  # crashed mid-publish: no _SUCCESS, ignored as before
    plan = plan_resume(store, resume=True, on_damaged="fail")
    assert (plan.start, plan.damaged, plan.error) == (6, {}, "")

    # step 6: same size, other bytes (only the hash of the chosen checkpoint can tell)
    store.put_bytes(step_prefix(6) + "/model.safetensors", b"\x01" + bytes(63))
    plan = plan_resume(store, resume=True, on_damaged="fail")
    assert plan.start == 0 and "step-000000006/model.safetensors" in plan.error and "sha256 mismatch" in plan.error
    plan = plan_resume(store, resume=True, on_damaged="previous")
    assert (plan.start, plan.prefix, sorted(plan.damaged), plan.error) == (4, step_prefix(4), [6], "")

    # step 4: another size; its manifest/_SUCCESS pair is fine -- damaged, found without hashing
    store.put_bytes(step_prefix(4) + "/trainer_state.json", b"{}")
    plan = plan_resume(store, resume=True, on_damaged="previous")
    assert (plan.start, sorted(plan.damaged)) == (2, [4, 6])
    assert "has 2 bytes, manifest says" in plan.damaged[4]
    # resume=false still knows what must not be published over (found without hashing)
    assert sorted(plan_resume(store, resume=False, on_damaged="fail").damaged) == [4]
