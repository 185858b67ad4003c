"""Resume planning on an S3 checkpoint store (SeaweedFS): damaged told from crashed, as on a file store
(tests/unit/train/test_train_damaged.py)."""
from __future__ import annotations

from peagle.storage import S3Store
from support.seaweed import BUCKET, unique
from support.train_checkpoints import check_plan_resume_tells_damaged_from_crashed


def test_plan_resume_tells_damaged_from_crashed_on_s3(seaweed_server):
    check_plan_resume_tells_damaged_from_crashed(S3Store(BUCKET, unique("dmg"), seaweed_server.settings()))
