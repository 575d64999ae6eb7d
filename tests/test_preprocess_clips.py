"""Preprocess with clips: video files beside images become windows of frames at a target rate,
known by the frames they show; what cannot be a clip, or is too short, is a report row."""
from __future__ import annotations

import json

import pytest
import yaml
from clips import scene, write_clip
from test_preprocess import image, preprocess

from lorapipe.stages.preprocess import PreprocessParams
from lorapipe.stages.preprocess.clips import VideoSampling


@pytest.fixture
def clips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name, frames in (("walk", 40), ("run", 24), ("blink", 5)):  # 2.5 s, 1.5 s, 0.31 s at 16 fps
        write_clip(data / f"{name}.mp4", scene(frames))
        (data / f"{name}.txt").write_text(f"a square, {name}")
    image(data / "still.png", size=(48, 32))
    return data


def test_each_clip_becomes_windows_at_the_target_rate_and_a_short_one_is_rejected(clips, tmp_path):
    samples, report, _, _ = preprocess(clips, tmp_path, video={"fps": 8, "num_frames": 9}, holdout_fraction=0)
    by_id = {s["id"]: s for s in samples}
    assert set(by_id) == {"walk", "run", "still"}
    assert by_id["walk"]["frames"] == [0, 2, 4, 6, 8, 10, 12, 14, 16]  # 16 fps source, every second frame
    assert by_id["walk"]["fps"] == 8  # what a family conditions on (LTX-2's positions in seconds)
    assert by_id["walk"]["size"] == [64, 64] and "frames" not in by_id["still"]
    assert by_id["run"]["clip"]["duration"] == pytest.approx(1.5)
    assert report["rejected"] == [{"path": "blink.mp4", "reason": "too_short",
                                   "detail": "0.31 s long; a window of 9 frames at 8 fps needs 1.12 s"}]
    walk = next(c for c in report["clips"] if c["path"] == "walk.mp4")
    assert walk["windows"] == [{"id": "walk", "start": 0.0, "frames": 9, "size": "64x64", "split": "train"}]
    assert walk["fps"] == pytest.approx(16) and walk["cut"] == "1.38 s of 2.50 s unused"


def test_a_clip_too_short_for_num_frames_takes_the_longest_frame_bucket_that_fits(clips, tmp_path):
    write_clip(clips / "flash.mp4", scene(1))  # a one-frame clip is a one-frame window, as a still is
    (clips / "flash.txt").write_text("a flash")
    video = {"fps": 16, "num_frames": 33, "frame_buckets": [17, 5, 1]}
    samples, report, _, _ = preprocess(clips, tmp_path, video=video, holdout_fraction=0)
    assert {s["id"]: len(s.get("frames", [1])) for s in samples} == {"walk": 33, "run": 17, "blink": 5, "flash": 1,
                                                                      "still": 1}
    assert report["rejected"] == []


@pytest.mark.parametrize("strategy, starts, second_first_frame", [
    ("uniform", [0.0, 0.96875, 1.9375], 15),  # spread over the 2.5 s clip; 0.96875 s is between frames 15 and 16
    ("sequential", [0.0, 0.5625, 1.125], 9),  # back to back
])
def test_several_windows_per_clip_are_placed_by_the_strategy_and_held_out_together(clips, tmp_path, strategy, starts,
                                                                                  second_first_frame):
    video = {"fps": 16, "num_frames": 9, "windows": strategy, "max_windows": 3}
    samples, _, _, _ = preprocess(clips, tmp_path, video=video, holdout_fraction=0.5)
    walk = sorted((s for s in samples if s["path"] == "walk.mp4"), key=lambda s: s["id"])
    assert [s["id"] for s in walk] == ["walk@0", "walk@1", "walk@2"]
    assert [s["clip"]["start"] for s in walk] == pytest.approx(starts)
    assert walk[1]["frames"][0] == second_first_frame  # the nearest frame, the earlier on a tie
    assert len({s["digest"] for s in walk}) == 3  # three windows, three contents
    for path in ("walk.mp4", "run.mp4"):
        assert len({s["split"] for s in samples if s["path"] == path}) == 1  # a clip's windows never straddle


def test_a_clip_is_known_by_its_frames_not_its_container(clips, tmp_path):
    (clips / "walk.mp4").rename(clips / "walk.old")
    write_clip(clips / "walk.mkv", scene(40))
    (clips / "walk.old").unlink()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    remuxed, _, _, _ = preprocess(clips, tmp_path / "b", video={"fps": 8, "num_frames": 9}, holdout_fraction=0)
    (clips / "walk.mkv").unlink()
    write_clip(clips / "walk.mp4", scene(40))
    original, _, _, _ = preprocess(clips, tmp_path / "a", video={"fps": 8, "num_frames": 9}, holdout_fraction=0)
    digest = {s["path"].rsplit(".", 1)[0]: s["digest"] for s in original}
    assert {s["path"].rsplit(".", 1)[0]: s["digest"] for s in remuxed} == digest


def test_what_cannot_be_a_clip_is_a_row_and_a_variable_frame_rate_a_warning(clips, tmp_path):
    (clips / "notes.mp4").write_text("not a video")
    (clips / "notes.txt").write_text("notes")
    write_clip(clips / "vfr.mkv", scene(30), pts=[round(i * 62.5) + (40 if i % 2 else 0) for i in range(30)])
    (clips / "vfr.txt").write_text("uneven")
    whole = (clips / "walk.mp4").read_bytes()
    (clips / "walk.mp4").write_bytes(whole[: len(whole) * 7 // 10])  # its index, written last, is cut off
    samples, report, _, _ = preprocess(clips, tmp_path, video={"fps": 8, "num_frames": 9}, holdout_fraction=0)
    rows = {r["path"]: r["reason"] for r in report["rejected"]}
    assert rows == {"notes.mp4": "not_a_video", "blink.mp4": "too_short", "walk.mp4": "truncated"}
    assert [w["path"] for w in report["warnings"] if w["reason"] == "variable_frame_rate"] == ["vfr.mkv"]
    assert "vfr" in {s["id"] for s in samples}


def test_each_window_takes_the_caption_of_its_time_range(clips, tmp_path):
    ranges = [{"start": 1, "end": 2.5, "text": "a square  leaving"},
              {"start": 0, "end": 1, "text": "a square entering"}]
    (clips / "metadata.jsonl").write_text(json.dumps({"file_name": "walk.mp4", "captions": ranges}) + "\n")
    cell = json.dumps([{"start": 0, "end": 1.5, "text": "a square running"}]).replace('"', '""')
    (clips / "metadata.csv").write_text(f'file_name,captions\nrun.mp4,"{cell}"\n')
    video = {"fps": 16, "num_frames": 9, "windows": "sequential", "max_windows": 3}
    samples, _, _, _ = preprocess(clips, tmp_path, video=video, holdout_fraction=0)
    assert {s["id"]: s["caption"] for s in samples} == {  # windows' middles: 0.28, 0.84, 1.41 s; walk.txt unused
        "walk@0": "a square entering", "walk@1": "a square entering", "walk@2": "a square leaving",
        "run@0": "a square running", "run@1": "a square running", "still": "a caption"}


def test_a_bad_time_range_is_a_row_naming_the_metadata_row_and_key(clips, tmp_path):
    rows = [("walk.mp4", [(0, 0.5)]), ("run.mp4", [(0, 1), (1, 3)]), ("blink.mp4", [(0, 0.2), (0.1, 0.3)]),
            ("still.png", [(0, 1)]), ("blink.mp4", [(1, 0.5)]), ("blink.mp4", [(0, 0.3)])]
    (clips / "metadata.jsonl").write_text("".join(json.dumps({"file_name": name, "captions": [
        {"start": start, "end": end, "text": "a square"} for start, end in ranges], **({"text": "a clip"} if line == 6
        else {})}) + "\n" for line, (name, ranges) in enumerate(rows, 1)))
    video = {"fps": 16, "num_frames": 9, "windows": "sequential", "max_windows": 3}
    samples, report, _, _ = preprocess(clips, tmp_path, video=video, holdout_fraction=0)
    assert {r["path"]: r["detail"] for r in report["rejected"] if r["reason"] == "bad_caption_range"} == {
        "metadata.jsonl:3": "captions[1] (0.1-0.3 s) overlaps captions[0] (0-0.2 s)",
        "metadata.jsonl:5": "captions[0]: end 0.5 s must come after start 1 s, and start be 0 or more",
        "metadata.jsonl:6": "both 'text' and captions are set: a clip's windows take the captions of their ranges;"
                            " remove one",
        "run.mp4": "metadata.jsonl:2 captions[1] (1-3 s) is outside the clip, which lasts 1.50 s",
        "walk.mp4": "metadata.jsonl:1 captions: no range holds the window at 0.56 s (its middle, 0.84 s)"}
    still = next(s for s in samples if s["id"] == "still")
    assert still["caption"] == "a caption"  # an image's row reads as before: a `captions` column there is its own
    with pytest.raises(ValueError, match=r"/metadata.jsonl:3: bad_caption_range: captions\[1\] \(0.1-0.3 s\) overlaps"
                                         r" captions\[0\] \(0-0.2 s\) \(and 2 more\); on_bad_row is error"):
        preprocess(clips, tmp_path, video=video, on_bad_row="error")


def test_clips_are_decoded_once_per_file_version_and_image_configs_keep_their_key(clips, tmp_path, monkeypatch):
    import lorapipe.stages.preprocess.sources as sources

    decoded = []
    read = sources.read_clip
    monkeypatch.setattr(sources, "read_clip", lambda path: decoded.append(path.name) or read(path))
    for _ in range(2):
        preprocess(clips, tmp_path, video={"fps": 8, "num_frames": 9})
    assert sorted(decoded) == ["blink.mp4", "run.mp4", "walk.mp4"]
    assert "video" not in PreprocessParams().model_dump(mode="json")
    assert "video" in PreprocessParams(video=VideoSampling(fps=8)).model_dump(mode="json")
    assert json.loads(PreprocessParams().model_dump_json()) == PreprocessParams().model_dump(mode="json")


def test_encode_reads_a_window_as_a_stack_of_placed_frames_and_notices_a_changed_clip(clips, tmp_path):
    from lorapipe.stages.encode.images import ImageCrops
    from lorapipe.stages.preprocess import DatasetSource
    from lorapipe.stages.preprocess.rows import SampleRow

    samples, _, _, _ = preprocess(clips, tmp_path, video={"fps": 8, "num_frames": 9}, holdout_fraction=0)
    walk = SampleRow.model_validate(next(s for s in samples if s["id"] == "walk"))
    crops = ImageCrops((DatasetSource(path=clips),), [walk, walk], [False, True])
    (_, plain, _), (_, mirrored, _) = crops[0], crops[1]
    assert plain.shape == (3, 9, 64, 64) and plain.min() >= -1 and plain.max() <= 1
    assert (mirrored == plain.flip(-1)).all()
    assert not (plain[:, 0] == plain[:, 1]).all()  # the square moved
    write_clip(clips / "walk.mp4", scene(40)[::-1])  # other frames under the same name
    assert crops[0][1:] == (None, "changed since preprocess ran (run the pipeline again)")


def test_an_image_model_refuses_clips_in_one_line_before_encoding_anything(clips, tmp_path, tiny_config, run_stages):
    from lorapipe.cache.errors import UserError

    config = tiny_config(tmp_path / "run", "clips")
    for clip in clips.glob("*.mp4"):
        (tmp_path / "run" / "data" / clip.name).write_bytes(clip.read_bytes())
        (tmp_path / "run" / "data" / clip.with_suffix(".txt").name).write_text("a square")
    settings = yaml.safe_load(config.read_text())
    settings["preprocess"]["video"] = {"fps": 8, "num_frames": 9}
    config.write_text(yaml.safe_dump(settings))
    with pytest.raises(UserError, match=r"^preprocess.video.num_frames / frame_buckets: Stable Diffusion 1.x/2.x is an"
                                        r" image model: it trains on images, not clips; \w+.mp4 has a window of 9"):
        run_stages(config, ("preprocess", "encode"))
    assert not list((tmp_path / "run" / "cache").glob("samples/*.tar"))  # nothing was encoded
