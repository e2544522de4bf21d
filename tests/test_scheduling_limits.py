"""The default frame cap that follows the text, and how it meets the server's limits."""

from __future__ import annotations

import pytest

from omni_stream.scheduling.limits import FrameCap, stream_frame_cap


def test_documented_formula():
    cap = FrameCap()
    assert [cap.frames(n) for n in (0, 1, 2, 100)] == [40, 52, 64, 1240]
    assert FrameCap(base_frames=10, frames_per_token=2.5).frames(3) == 18  # ceil(7.5) = 8


def test_limits_win_and_an_explicit_request_replaces_the_formula():
    cap = FrameCap()
    assert stream_frame_cap(None, 2, cap, server_max=1500, room=2000) == 64
    assert stream_frame_cap(None, 1000, cap, server_max=1500, room=2000) == 1500  # server ceiling
    assert stream_frame_cap(None, 100, cap, server_max=1500, room=300) == 300  # slot room
    assert stream_frame_cap(500, 2, cap, server_max=1500, room=2000) == 500  # the request
    assert stream_frame_cap(5000, 2, cap, server_max=1500, room=600) == 600
    assert stream_frame_cap(None, 2, cap, server_max=1500, room=0) == 1  # never below one frame


@pytest.mark.parametrize("kw", [dict(base_frames=0), dict(frames_per_token=0.0),
                                dict(frames_per_token=float("inf")),
                                dict(frames_per_token=float("nan"))])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        FrameCap(**kw)


@pytest.mark.parametrize("text, want", [
    (None, FrameCap()),
    ("40+12", FrameCap(40, 12.0)),
    ("1+4", FrameCap(1, 4.0)),
    ("1+0.5", FrameCap(1, 0.5)),
])
def test_frame_cap_flag(text, want):
    from omni_stream.orchestrator.flags import _frame_cap

    assert _frame_cap(text) == want


@pytest.mark.parametrize("text", ["40", "0+4", "-1+4", "4+0", "4+-1", "4+nan", "4+inf", "a+b",
                                  "+4", "4+", "", "9223372036854775808+1e400"])
def test_frame_cap_flag_refuses_bad_values_by_name(text):
    from omni_stream.orchestrator.flags import _frame_cap

    with pytest.raises(SystemExit, match="--frame-cap"):
        _frame_cap(text)
