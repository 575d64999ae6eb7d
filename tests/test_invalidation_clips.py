"""The cache invariants for clips, on the tiny Wan 2.1 and the tiny LTX-2 through the real stages (all
four run on the demo's clips), with encodes counted by forward hooks on their 3-D VAE encoders and
text encoders (UMT5, Gemma 3): a caption edit encodes one text record and no latent, and an edit of
one time range's caption only that window's text record; the frame count, frame rate or window
strategy re-encode only the windows whose frames changed, never a text; a clip re-muxed into
another container keeps its latents (it is known by its decoded frames); the timestep shift reruns
training only. On the tiny image-to-video models (Wan 2.1, HunyuanVideo 1.5 and Kandinsky 5 I2V, encode
only): a named conditioning image swapped encodes its one record (no window's latent, no text), a
caption edit one text record (its rows to each text encoder)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import av
import pytest
from invalidation_checks import TEXT_ROWS
from test_invalidation import make_config, run_all, statuses

from lorapipe.flows.steps import STAGES, Context
from lorapipe.flows.runner import explain
from lorapipe.stages.demo.clips import SCENES, write_demo_clips
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.families import build_tiny_model, for_model

pytestmark = pytest.mark.slow

VIDEO = {"preprocess": {"video": {"fps": 16, "num_frames": 9}},
         "train": {"max_steps": 4, "checkpoint_every": 2, "log_every": 2, "batch_size": 2},
         "evaluate": {"num_frames": 9}}
CLIPS = len(SCENES)


@pytest.fixture(scope="module", params=["wan2.1", "ltx2"])
def baseline(request, tmp_path_factory, count_encoder_rows):
    """One complete run over the demo clips per video family; every test starts from copies of its
    model and clips over its cache."""
    root = tmp_path_factory.mktemp(f"{request.param}-baseline")
    build_tiny_model(root / "model", request.param)
    write_demo_clips(root / "data")
    config = make_config(root, root / "model", root / "data", root / "cache", **VIDEO)
    with count_encoder_rows() as counts:
        encoded = run_all(config, STAGES[:2])
    assert statuses(encoded) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": CLIPS, "text": CLIPS + 1}  # one window per clip; its caption, the empty prompt
    samples = EncodedData(Path(encoded["encode"].path), root / "cache").samples
    assert {(s.frames, s.fps) for s in samples} == {(9, 16.0)}  # what a family conditions on
    results = run_all(config)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed", "evaluate": "computed"}
    return root


def clip_copy(baseline: Path, tmp_path: Path, video: dict | None = None, **sections):
    shutil.copytree(baseline / "model", tmp_path / "model")
    shutil.copytree(baseline / "data", tmp_path / "data")
    merged = {k: {**VIDEO.get(k, {}), **sections.get(k, {})} for k in {*VIDEO, *sections}}
    merged["preprocess"] = {"video": {**VIDEO["preprocess"]["video"], **(video or {})}}
    return make_config(tmp_path, tmp_path / "model", tmp_path / "data", baseline / "cache", **merged)


def encode_counted(config, count_encoder_rows) -> tuple[dict, dict]:
    with count_encoder_rows() as counts:
        results = run_all(config, STAGES[:2])
    return results, counts


def test_a_clip_caption_edit_encodes_one_text_record_and_no_latent(baseline, tmp_path, count_encoder_rows):
    assert_a_caption_edit_encodes_one_text_record(clip_copy(baseline, tmp_path), tmp_path, count_encoder_rows)


def assert_a_caption_edit_encodes_one_text_record(config, tmp_path: Path, count_encoder_rows, rows: int = 1) -> None:
    (tmp_path / "data" / f"{SCENES[0][0]}.txt").write_text("a red ball speeding to the right")
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 0, "text": rows}


def test_a_time_range_caption_edit_encodes_that_window_text_record_only(baseline, tmp_path, count_encoder_rows):
    def ranges(later: str) -> str:  # the windows' middles: 0.28 s and 2.28 s
        return json.dumps({"file_name": f"{SCENES[0][0]}.mp4", "captions": [
            {"start": 0, "end": 1, "text": "a red ball rolling in"}, {"start": 1, "end": 2.5, "text": later}]})

    config = clip_copy(baseline, tmp_path, {"windows": "uniform", "max_windows": 2})  # windows no other test takes
    (tmp_path / "data" / "metadata.jsonl").write_text(ranges("a red ball rolling away"))
    _, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": CLIPS, "text": 2}  # each clip's last window; that clip's two captions
    (tmp_path / "data" / "metadata.jsonl").write_text(ranges("a red ball rolling out of sight"))
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 0, "text": 1}


@pytest.mark.parametrize("video", [{"num_frames": 1}, {"fps": 8}], ids=["num_frames", "fps"])
def test_the_frames_a_window_takes_re_encode_its_latents_and_no_text(baseline, tmp_path, count_encoder_rows,
                                                                     video):
    config = clip_copy(baseline, tmp_path, video)
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": CLIPS, "text": 0}


def test_a_second_window_per_clip_encodes_only_the_new_windows(baseline, tmp_path, count_encoder_rows):
    config = clip_copy(baseline, tmp_path, {"windows": "sequential", "max_windows": 2})
    results, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": CLIPS, "text": 0}  # each clip's first window is the head window of before
    assert results["encode"].info["latents_reused"] == CLIPS


def test_a_clip_remuxed_into_another_container_keeps_its_latents(baseline, tmp_path, count_encoder_rows):
    config = clip_copy(baseline, tmp_path)
    name = SCENES[0][0]
    remux(tmp_path / "data" / f"{name}.mp4", tmp_path / "data" / f"{name}.mkv")
    (tmp_path / "data" / f"{name}.mp4").unlink()
    results, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": 0, "text": 0}  # encode reruns for the new file name, and encodes nothing
    assert results["encode"].digest == run_all(clip_copy(baseline, tmp_path / "b"), STAGES[:2])["encode"].digest
    rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
    assert rows["train"]["status"] == "hit"  # the same encoded data: training and evaluation stand


def test_the_timestep_shift_reruns_training_only(baseline, tmp_path, count_encoder_rows):
    config = clip_copy(baseline, tmp_path, train={"timestep_sampling": {"shift": "static", "shift_value": 5.0}})
    rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
    assert [rows[s]["status"] for s in STAGES] == ["hit", "hit", "miss", "miss"]
    assert "params.timestep_sampling" in rows["train"]["reason"]


def remux(source: Path, target: Path) -> None:
    """The same coded frames in another container (no decode, no re-encode)."""
    with av.open(str(source)) as inp, av.open(str(target), "w") as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)


@pytest.fixture(scope="module", params=["wan2.1-i2v", "hunyuanvideo1.5-i2v", "kandinsky5-i2v"])
def i2v_baseline(request, tmp_path_factory, tiny_models, count_encoder_rows):
    """The demo clips on a tiny image-to-video model, encoded: the first clip's conditioning image named
    in control_dir, the others' their windows' first frames; each window's record and its conditioning
    image's (Wan 2.1 I2V: the padded clip through the VAE, with its CLIP-vision embedding;
    HunyuanVideo 1.5 I2V: the image alone, with its SigLIP embedding; Kandinsky 5 I2V: the image alone)."""
    root = tmp_path_factory.mktemp(f"{request.param}-baseline")
    shutil.copytree(tiny_models(request.param), root / "model")
    write_demo_clips(root / "data")
    (root / "data" / "control").mkdir()
    conditioning_image(root, (200, 30, 30))
    with count_encoder_rows() as counts:
        encoded = run_all(i2v_config(root, root), STAGES[:2])
    rows = caption_rows(root)
    assert counts == {"vae": 2 * CLIPS, "text": rows * (CLIPS + 1)}  # a window and its conditioning image per clip
    samples = EncodedData(Path(encoded["encode"].path), root / "cache").samples
    assert all(len(s.references) == 1 for s in samples)
    return root


def caption_rows(baseline: Path) -> int:
    return TEXT_ROWS.get(for_model(baseline / "model").name, 1)


def conditioning_image(root: Path, colour: tuple[int, int, int]) -> None:
    from PIL import Image

    Image.new("RGB", (64, 64), colour).save(root / "data" / "control" / f"{SCENES[0][0]}.png")


def i2v_config(root: Path, baseline: Path):
    return make_config(root, root / "model", {"datasets": [{"path": root / "data", "control_dir": "control"}]},
                       baseline / "cache",
                       **VIDEO)


def i2v_copy(baseline: Path, tmp_path: Path):
    shutil.copytree(baseline / "model", tmp_path / "model")
    shutil.copytree(baseline / "data", tmp_path / "data")
    return i2v_config(tmp_path, baseline)


def encoded_keys(result, cache: Path) -> tuple[set[str], set[str]]:
    """The windows' latent record keys and their conditioning images'."""
    samples = EncodedData(Path(result.path), cache).samples
    return {s.latent.key for s in samples}, {r.key for s in samples for r in s.references}


def test_a_swapped_conditioning_image_encodes_its_one_record(i2v_baseline, tmp_path, count_encoder_rows):
    """A named conditioning image replaced: its record alone (no window's latent, no text)."""
    before = encoded_keys(run_all(i2v_config(i2v_baseline, i2v_baseline), STAGES[:2])["encode"],
                          i2v_baseline / "cache")
    config = i2v_copy(i2v_baseline, tmp_path)
    conditioning_image(tmp_path, (30, 200, 30))
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 1, "text": 0} and results["encode"].info["latents_encoded"] == 1
    windows, conditions = encoded_keys(results["encode"], i2v_baseline / "cache")
    assert windows == before[0] and len(conditions - before[1]) == 1


def test_an_i2v_caption_edit_encodes_one_text_record_and_no_latent(i2v_baseline, tmp_path, count_encoder_rows):
    assert_a_caption_edit_encodes_one_text_record(i2v_copy(i2v_baseline, tmp_path), tmp_path, count_encoder_rows,
                                                  caption_rows(i2v_baseline))


def test_an_image_in_an_i2v_dataset_is_refused_in_one_line(i2v_baseline, tmp_path):
    """Without control_dir (which rejects a target it names no image for), a still image reaches encode."""
    from PIL import Image

    from lorapipe.cache.errors import UserError

    i2v_copy(i2v_baseline, tmp_path)
    shutil.rmtree(tmp_path / "data" / "control")
    config = make_config(tmp_path, tmp_path / "model", tmp_path / "data", i2v_baseline / "cache", **VIDEO)
    Image.new("RGB", (64, 64), (10, 20, 30)).save(tmp_path / "data" / "still.png")
    (tmp_path / "data" / "still.txt").write_text("a still")
    label = for_model(tmp_path / "model").label  # Wan I2V, HunyuanVideo 1.5 I2V, Kandinsky 5 I2V
    with pytest.raises(UserError, match=rf"^data.datasets: still.png is an image, but {label} trains image-to-video"
                                        r" on clips \(each window conditioned on an image\): remove it"):
        run_all(config, STAGES[:2])
