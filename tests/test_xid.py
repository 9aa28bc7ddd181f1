"""The XID policy: the catalog's immediate-action bucket, with the operator's overrides."""

from __future__ import annotations

import pytest

from nvplug.core.xid_policy import Verdict, XidPolicy, load_catalog


@pytest.mark.parametrize(
    ("code", "verdict", "reason"),
    [
        (13, Verdict.HEALTHY, "XID 13 ROBUST_CHANNEL_GR_EXCEPTION"),
        (31, Verdict.HEALTHY, "(RESTART_APP)"),
        (43, Verdict.HEALTHY, "(IGNORE)"),
        (45, Verdict.HEALTHY, "(WORKFLOW_XID_45)"),
        (94, Verdict.HEALTHY, "ROBUST_CHANNEL_CONTAINED_ERROR"),
        (46, Verdict.UNHEALTHY, "(RESET_GPU)"),
        (48, Verdict.UNHEALTHY, "XID 48 ROBUST_CHANNEL_GPU_ECC_DBE (WORKFLOW_XID_48)"),
        (54, Verdict.UNHEALTHY, "(CHECK_MECHANICALS)"),
        (74, Verdict.UNHEALTHY, "(WORKFLOW_NVLINK_ERR)"),
        (79, Verdict.UNHEALTHY, "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)"),
        (109, Verdict.UNHEALTHY, "(RESET_GPU)"),
        (145, Verdict.UNHEALTHY, "(WORKFLOW_NVLINK5_ERR)"),
        (154, Verdict.RECOVERY_ACTION, "XID 154 GPU_RECOVERY_ACTION_CHANGED"),
        (162, Verdict.INFORMATIONAL, "no catalog action"),
        (9999, Verdict.INFORMATIONAL, "XID 9999 (no catalog action)"),
    ],
)
def test_catalog_defaults(code: int, verdict: Verdict, reason: str) -> None:
    decision = XidPolicy().decide(code)
    assert decision.verdict is verdict
    assert reason in decision.reason


def test_overrides_win_over_the_catalog() -> None:
    policy = XidPolicy.with_overrides(ignore=[79], fatal=[13])
    assert policy.decide(79).verdict is Verdict.HEALTHY
    assert "(ignored by config)" in policy.decide(79).reason
    assert policy.decide(13).verdict is Verdict.UNHEALTHY
    assert "(fatal by config)" in policy.decide(13).reason


def test_an_xid_cannot_be_both() -> None:
    with pytest.raises(ValueError, match=r"\[48\] are both ignored and fatal"):
        XidPolicy.with_overrides(ignore=[48], fatal=[48])


def test_shipped_catalog_is_complete_and_parses_quoted_fields() -> None:
    catalog = load_catalog()
    assert len(catalog) == 111
    assert catalog[13].action == "RESTART_APP"  # its description holds commas inside quotes
    assert catalog[172].action == ""
