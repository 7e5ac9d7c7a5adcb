"""Power cuts under ``deltaq up`` with ``ack = "commit"``: once, as test_power_cut_up.py does
twice with the journal acknowledging."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import power_cut
from tests.acceptance.test_power_cut_up import cut_up_and_check

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(power_cut.missing() is not None, reason=str(power_cut.missing())),
]


# deltaq up started three times on the power-cut disk, beside the rest of the suite.
@pytest.mark.timeout(900)
def test_up_with_commit_acks_after_a_power_cut_channels_hold_every_message_once(
    disk: power_cut.PowerCutDisk, tmp_path: Path
) -> None:
    cut_up_and_check(disk, tmp_path, ack="commit", cuts=1)
