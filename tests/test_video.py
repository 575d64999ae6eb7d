"""Reading clips with PyAV: frames known by their decoded pixels, turned upright by the display
matrix, timed by their own timestamps; every way a file can fail to be a clip is one reason code.
The clips are written here with PyAV's own encoders (a few KB each)."""
from __future__ import annotations

import av
import numpy as np
import pytest
from clips import scene, write_clip

from lorapipe.stages import video
from lorapipe.stages.video import VideoProblem, decode_frames, read_clip

MIRRORED = [-65536, 0, 0, 0, 65536, 0, 0, 0, 1 << 30]  # x negated: FFmpeg reads it as 180 degrees


@pytest.mark.parametrize("suffix, codec", [(".mp4", "libx264"), (".mkv", "libx264"), (".mov", "libx264"),
                                           (".webm", "libvpx-vp9"), (".gif", "gif")])
def test_each_container_reads_as_a_clip_with_its_frames_and_rate(tmp_path, suffix, codec):
    clip = read_clip(write_clip(tmp_path / f"clip{suffix}", scene(12), codec))
    assert (clip.width, clip.height, clip.rotation) == (48, 32, 0)
    assert len(clip.times) == len(clip.digests) == 12 and len(set(clip.digests)) == 12
    assert clip.fps == pytest.approx(16, rel=0.05) and clip.duration == pytest.approx(12 / 16, rel=0.05)
    assert not clip.variable_frame_rate
    frames = decode_frames(tmp_path / f"clip{suffix}", [0, 5, 5])
    assert frames.shape == (3, 32, 48, 3) and (frames[1] == frames[2]).all()


def test_the_same_frames_in_another_container_are_the_same_clip(tmp_path):
    frames = scene(9)
    in_mp4 = read_clip(write_clip(tmp_path / "a.mp4", frames))
    in_mkv = read_clip(write_clip(tmp_path / "b.mkv", frames))
    assert in_mp4.digests == in_mkv.digests and in_mp4.times == pytest.approx(in_mkv.times, abs=1e-3)
    assert (tmp_path / "a.mp4").read_bytes() != (tmp_path / "b.mkv").read_bytes()
    lossy = read_clip(write_clip(tmp_path / "c.mp4", frames, lossless=False))
    assert lossy.digests != in_mp4.digests  # other pixels: another clip


def test_a_sideways_phone_clip_is_turned_upright_by_its_display_matrix(tmp_path):
    frames = scene(4)
    coded = decode_frames(write_clip(tmp_path / "coded.mp4", frames), [2])[0]
    path = write_clip(tmp_path / "phone.mp4", frames, rotation=90)
    clip = read_clip(path)
    assert (clip.width, clip.height, clip.rotation) == (32, 48, 90)
    assert (decode_frames(path, [2])[0] == np.rot90(coded)).all()  # turned 90 degrees counter-clockwise
    with pytest.raises(VideoProblem, match="^unsupported_rotation: the display matrix mirrors it"):
        read_clip(write_clip(tmp_path / "selfie.mp4", frames, display_matrix=MIRRORED))  # never turned 180 degrees


def test_a_variable_frame_rate_clip_is_timed_by_its_frames(tmp_path):
    pts = [0, 62, 125, 250, 312, 375, 500]  # ms: some frames twice as long as others
    clip = read_clip(write_clip(tmp_path / "vfr.mkv", scene(7), pts=pts))
    assert clip.variable_frame_rate
    assert clip.times == pytest.approx([p / 1000 for p in pts], abs=1e-3)


@pytest.mark.parametrize("name, pts", [("steady.mp4", None),
                                       ("vfr.mkv", [round(i * 62.5) + 30 * (i % 3) for i in range(40)])])
def test_a_window_is_decoded_from_the_keyframe_before_it_with_the_same_pixels(tmp_path, monkeypatch, name, pts):
    path = write_clip(tmp_path / name, scene(20) * 2, lossless=False, keyframe_every=8, pts=pts)
    whole = decode_frames(path, list(range(40)))  # from the first frame
    decoded, frames = [], video._frames

    def counted(*args):
        for frame in frames(*args):
            decoded.append(frame)
            yield frame

    monkeypatch.setattr(video, "_frames", counted)
    for first in (9, 21, 35):
        decoded.clear()
        assert (decode_frames(path, list(range(first, first + 5))) == whole[first:first + 5]).all()
        assert len(decoded) <= 7 + 5  # at most a keyframe interval before the window, not from frame 0


@pytest.mark.parametrize("suffix, codec, kept, says", [
    (".mkv", "libx264", 0.7, r"1\.\d\d s decodes of the 3\.00 s the container declares"),
    (".webm", "libvpx-vp9", 0.7, r"1\.\d\d s decodes of the 3\.00 s the container declares"),
    (".mp4", "libx264", 0.4, r"it ends at byte \d+ of the \d+ its boxes declare, before its index \(moov box\)"),
    (".mp4", "libx264", 0.7, r"it ends at byte \d+ of the \d+ its boxes declare, inside its index \(moov box\)"),
])
def test_a_clip_cut_short_is_truncated_not_a_shorter_clip(tmp_path, suffix, codec, kept, says):
    whole = write_clip(tmp_path / f"whole{suffix}", scene(24) * 2, codec, lossless=False).read_bytes()  # 3 s
    (tmp_path / f"cut{suffix}").write_bytes(whole[: int(len(whole) * kept)])
    with pytest.raises(VideoProblem, match=f"^truncated: {says}"):
        read_clip(tmp_path / f"cut{suffix}")


def test_what_is_not_a_clip_is_one_reason(tmp_path):
    audio = tmp_path / "voice.mp4"
    with av.open(str(audio), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    (tmp_path / "notes.mp4").write_text("not a video")
    whole = write_clip(tmp_path / "whole.mkv", scene(30), lossless=False).read_bytes()
    (tmp_path / "cut.mkv").write_bytes(whole[: len(whole) * 2 // 3])
    reasons = {}
    for name in ("voice.mp4", "notes.mp4", "cut.mkv"):
        with pytest.raises(VideoProblem) as problem:
            read_clip(tmp_path / name)
            decode_frames(tmp_path / name, [29])
        reasons[name] = problem.value.reason
    assert reasons == {"voice.mp4": "no_video", "notes.mp4": "not_a_video", "cut.mkv": "truncated"}
