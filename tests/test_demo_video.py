"""`lorapipe demo --arch ARCH` for the video families end to end through Prefect, twice: the demo
writes the generated clips (stages/demo/clips.py) into its data folder, trains the tiny model on
17-frame windows of them, renders clips, and a second run is all cache hits. Every family's demo
runs in one command (`lorapipe demo --arch A --arch B ...`), their reruns in another: one process,
Prefect server and process started ahead for all, as a user's would."""
from __future__ import annotations

import json
from pathlib import Path

import av
import pytest
from PIL import Image
from test_demo import demos_on_tiny_models, several_demos

from lorapipe.stages.demo.clips import SCENES

pytestmark = pytest.mark.slow

WAN_FILES, WITH_COMFYUI = ("", "_comfyui", "_kohya"), ("", "_comfyui")
LORA_FILES = {"wan2.1": WAN_FILES, "wan2.2-a14b": WAN_FILES, "wan2.1-i2v": WAN_FILES, "wan2.2-i2v-a14b": WAN_FILES,
              "wan2.2-5b-i2v": WAN_FILES, **dict.fromkeys(("ltx2", "ltx2-i2v", "hunyuanvideo1.5", "hunyuanvideo1.5-i2v",
                                                           "kandinsky5-video", "kandinsky5-i2v", "ltx2.5"), WITH_COMFYUI)}
CONDITIONED = {"wan2.1-i2v", "wan2.2-i2v-a14b", "wan2.2-5b-i2v", "ltx2-i2v", "kandinsky5-i2v",
               "hunyuanvideo1.5-i2v"}  # image-to-video: a conditioning image per window, its own record; clips rendered from
# the held-out windows' first frames beside them (edit_grid.png)
FRAMES = 17  # configs/video-demo.yaml's preprocess.video.num_frames and evaluate.num_frames
RENDERED = 2 * 1 * 2  # prompts x seeds (ONE_SEED) x columns (the base model, the LoRA at scale 1)
FPS = 12  # the windows' frame rate (the generated clips have 16): what the rendered clips must play at
ONE_SEED = ("--set", "evaluate.seeds=[0]")  # half the clips to render: no check here needs a second seed
AT_FPS = ("--set", f"preprocess.video.fps={FPS}", *ONE_SEED)


@pytest.fixture(scope="module")
def video_demos(tmp_path_factory, tiny_models):
    """Each video family's demo in one `lorapipe demo` command, in a workdir named after its arch as a
    user may name it (a folder `ltx2` in the working directory once hid the LTX-2 connectors'
    module): the folder, the command, each demo's part of its output, each run summary it left."""
    root = tmp_path_factory.mktemp("video")
    command, parts = demos_on_tiny_models(list(LORA_FILES), root, tiny_models, *AT_FPS)
    summaries = {arch: json.loads(path.read_text()) for arch in LORA_FILES
                 if (path := root / arch / "outputs" / "run-summary.json").is_file()}
    return root, command, parts, summaries


@pytest.mark.parametrize("arch", list(LORA_FILES))
def test_video_demo_trains_on_the_generated_clips(video_demos, arch):
    """Trained on windows at 12 fps, its clips play at 12 fps, published with the rest."""
    root, command, parts, summaries = video_demos
    first = parts[arch]
    assert first.error() is None, first.stderr[-3000:]
    assert command.returncode == (1 if any(part.error() for part in parts.values()) else 0)
    run = root / arch
    assert sorted(p.name for p in (run / "data").iterdir()) == sorted(
        f"{name}{suffix}" for name, *_ in SCENES for suffix in (".mp4", ".txt"))  # the clips, not the photos
    if arch.endswith("a14b"):  # two denoisers: the demo trains the first, and its config says so
        assert "with train.denoiser: high_noise" in (run / "demo.yaml").read_text().splitlines()[0]
    outputs = run / "outputs"
    names = [f"pytorch_lora_weights{suffix}.safetensors" for suffix in LORA_FILES[arch]]
    for name in (*names, "grid.png", "grid.webp", "metrics.json", "run-summary.json"):
        assert (outputs / name).is_file(), name
    named = {"LoRA": names[0], "sample grid": "grid.png", "animated sample grid": "grid.webp", "clips": "clips",
             "metrics": "metrics.json", "run summary": "run-summary.json"}
    said = dict(line.split(": ", 1) for line in first.stdout.splitlines() if line.split(": ")[0] in named)
    assert {label: path.strip() for label, path in said.items()} == {k: str(outputs / v) for k, v in named.items()}
    with Image.open(outputs / "grid.webp") as grid:
        grid.load()  # a frame's duration is read with its pixels
        assert grid.n_frames == FRAMES and grid.info["duration"] == round(1000 / FPS)
    assert f"preprocess: {len(SCENES)} windows of {len(SCENES)} clips (2 held out)" in first.stderr

    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["n_samples_in_split"] == {"holdout": 2, "train": len(SCENES) - 2}
    train = metrics["loss"]["train"]
    assert train["lora"]["overall"] < train["base"]["overall"]
    summary = summaries[arch]
    assert [s["status"] for s in summary["stages"]] == ["computed"] * 4
    assert summary["stages"][1]["info"]["latents_encoded"] == len(SCENES) * (2 if arch in CONDITIONED else 1)
    if arch in CONDITIONED:
        assert metrics["edit"]["pairs"] == 2 and (outputs / "edit_grid.png").is_file()
    evaluated = Path(summary["stages"][3]["path"])
    assert metrics["clips"][0] == "grid.webp" and len(metrics["clips"]) == 1 + RENDERED
    assert all((evaluated / clip).is_file() for clip in metrics["clips"])
    assert all((outputs / clip).is_file() for clip in metrics["clips"])  # published: the paths resolve there
    assert f"{RENDERED} clips in clips/" in first.stderr
    assert metrics["clip_fps"] == FPS and f"mp4 at {FPS} fps" in (outputs / "report.md").read_text()
    with av.open(str(outputs / metrics["clips"][1])) as clip:
        assert clip.streams.video[0].average_rate == FPS and clip.streams.video[0].frames == FRAMES


@pytest.fixture(scope="module")
def video_reruns(video_demos):
    """The same command again, after the tests above read the first runs."""
    return several_demos(list(LORA_FILES), video_demos[0], *AT_FPS, report_loaded=True)


@pytest.mark.parametrize("arch", list(LORA_FILES))
def test_video_demo_run_again_is_all_hits(video_demos, video_reruns, arch):
    """The command again is all cache hits, its keys computed without the model code."""
    root, *_, summaries = video_demos
    second, parts = video_reruns
    assert parts[arch].error() is None, parts[arch].stderr[-3000:]
    assert second.returncode == (1 if any(part.error() for part in parts.values()) else 0)
    assert second.stderr.splitlines()[-1] == "loaded: []"  # keys computed without the model code
    again = json.loads((root / arch / "outputs" / "run-summary.json").read_text())
    assert [s["status"] for s in again["stages"]] == ["hit"] * 4
    assert [s["key"] for s in again["stages"]] == [s["key"] for s in summaries[arch]["stages"]]
    assert all(s["info"] == {} for s in again["stages"])  # a hit encodes, trains and renders nothing
