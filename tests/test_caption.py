"""The caption stage (CAPTION-DESIGN.md) on the tiny Qwen2.5-VL captioner and the tiny SD1.5, through
the real preprocess, caption and encode stages (no Prefect, which only wraps the same calls in tasks).
Captions are counted by wrapping generate() and encodes by forward hooks, not by the stages' counters:
+N images -> N captions; a prompt change -> all; a rename -> none; a caption the user wrote is never
changed on disk and each policy gives its documented caption; a new generated caption re-encodes one
text record; a config without a caption section runs the stages it ran before."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FEWER_STEPS, LIBRARY_WARNINGS_SHOWN, REPO
from PIL import Image
from published import published_report
from test_invalidation import SMALL, run_all, statuses

from lorapipe.cache.errors import UserError
from lorapipe.flows.config import ConfigError, validate_config
from lorapipe.flows.outputs import with_files
from lorapipe.flows.steps import STAGES, Context, config_stages
from lorapipe.flows.runner import explain, run_stage
from lorapipe.stages.caption import CAPTIONS_FILE, CaptionParams
from lorapipe.stages.caption.captioners import load_captioner
from lorapipe.stages.preprocess import DATASET_FILE, dataset_ingredients
from lorapipe.stages.preprocess.sources import DatasetSource

UNCAPTIONED = ("hubble_deep_field", "immunohistochemistry", "retina", "rocket")
CAPTION = {"max_new_tokens": 6, "batch_size": 2, "shard_records": 2}
UPTO_CAPTION = ("preprocess", "caption")


def raw_config(tmp: Path, model: Path, data: Path | dict, cache: Path, captioner: Path | None, **caption) -> dict:
    raw = {"name": "t", "cache_dir": str(cache), "output_dir": str(tmp / "out"), "model": {"path": str(model)},
           "data": data if isinstance(data, dict) else {"path": str(data)}, **SMALL}
    if captioner is not None:
        raw["caption"] = {"model": str(captioner), **CAPTION, **caption}
    return raw


def half_captioned(demo_images: Path, folder: Path) -> Path:
    """The demo photos, four of them without their caption sidecar."""
    shutil.copytree(demo_images, folder)
    for name in UNCAPTIONED:
        (folder / f"{name}.txt").unlink()
    return folder


def new_image(data: Path, name: str, source: str = "chelsea") -> None:
    """An image of new content (a demo photo mirrored), without a caption."""
    with Image.open(data / f"{source}.jpg") as im:
        im.transpose(Image.FLIP_LEFT_RIGHT).save(data / f"{name}.jpg", quality=90)


def captions_of(results: dict) -> dict:
    return json.loads((Path(results["caption"].path) / CAPTIONS_FILE).read_text())


def caption_again(config, log=lambda line: None):
    """The caption stage's result, built again (forced) on the preprocess artifact from the cache."""
    ctx = Context(config, log=log)
    try:
        pre = run_stage(ctx, "preprocess", {})[1]
        return run_stage(ctx, "caption", {"preprocess": pre}, force=True)[0]
    finally:
        ctx.close()


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("settings", [{}, {"num_beams": 2}, {"do_sample": True, "temperature": 0.7, "top_p": 0.9}])
def test_the_captioner_is_the_bare_generate_loop(tiny_captioner, demo_images, settings):
    """ChatCaptioner gives what Qwen2.5-VL's documented usage gives on the same batch with the same
    generate() arguments: greedy by default (one beam), with beams, sampled with the same seed."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    images = [Image.open(demo_images / f"{n}.jpg").convert("RGB") for n in ("astronaut", "coffee", "rocket")]
    prompt = "Describe this image."
    captioner = load_captioner(tiny_captioner, CaptionParams(max_new_tokens=8, **settings), "cpu", torch.float32)
    processor = AutoProcessor.from_pretrained(tiny_captioner)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(tiny_captioner)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text] * 3, images=images, padding=True, return_tensors="pt")
    torch.manual_seed(7)
    out = model.generate(**inputs, max_new_tokens=8, **{"do_sample": False, **settings})
    bare = [t.strip() for t in processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)]
    torch.manual_seed(7)
    assert captioner(images, prompt) == bare
    assert all(bare)


def test_sampling_settings_are_keyed_only_when_sampling(tmp_path, tiny_model, tiny_captioner):
    from lorapipe.stages.caption import resolved

    params = resolved(CaptionParams(), tiny_captioner)
    assert params.num_beams == 1 and params.generation() == {"max_new_tokens": 64, "do_sample": False, "num_beams": 1}
    key = params.record_key("image", "captioner", "prompt")
    assert params.model_copy(update={"num_beams": 2}).record_key("image", "captioner", "prompt") != key
    sampled = params.model_copy(update={"do_sample": True})
    assert sampled.generation() == {"max_new_tokens": 64, "do_sample": True, "num_beams": 1}  # generation_config's
    keys = {sampled.model_copy(update=u).record_key("image", "captioner", "prompt")
            for u in ({}, {"temperature": 0.5}, {"top_p": 0.5}, {"seed": 1})}
    assert len(keys) == 4 and key not in keys
    with pytest.raises(ConfigError, match=r"caption: .*temperature and top_p set but do_sample is false"):
        validate_config(raw_config(tmp_path, tiny_model, tmp_path, tmp_path, tiny_captioner, temperature=0.5,
                                   top_p=0.9), "test")


def test_tiny_model_rebuilds_the_demos_tiny_captioner_byte_for_byte_and_prints_only_its_folder(tmp_path,
                                                                                                tiny_captioner):
    """`lorapipe tiny-model DIR --arch captioner` builds the captioner `demo --caption` uses (the
    fixture's builder), the same bytes; no note of a library it never uses (torchao's) on the terminal."""
    folder = tmp_path / "captioner"
    built = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "tiny-model", str(folder), "--arch", "captioner"],
                           cwd=REPO, env={**os.environ, **LIBRARY_WARNINGS_SHOWN}, capture_output=True, text=True, timeout=300)
    assert (built.returncode, built.stdout, built.stderr) == (0, f"{folder}\n", "")
    assert files(folder) == files(tiny_captioner)


def test_config_rules_name_their_keys(tmp_path, tiny_model, tiny_captioner):
    with pytest.raises(ConfigError, match=r"preprocess\.missing_caption: generate needs a `caption:` section"):
        validate_config(raw_config(tmp_path, tiny_model, tmp_path, tmp_path, None) | {
            "preprocess": {"missing_caption": "generate"}}, "test")
    data = {"datasets": [{"path": str(tmp_path), "missing_caption": "generate"}]}
    with pytest.raises(ConfigError, match=r"data\.datasets\.0\.missing_caption: generate needs"):
        validate_config(raw_config(tmp_path, tiny_model, data, tmp_path, None), "test")
    for entry, problem in (({"caption_policy": "prefix"}, "caption_policy: prefix needs caption_text"),
                           ({"caption_text": "lpdemo"}, "caption_text is set but caption_policy is fill_missing")):
        data = {"datasets": [{"path": str(tmp_path), **entry}]}
        with pytest.raises(ConfigError, match=problem):
            validate_config(raw_config(tmp_path, tiny_model, data, tmp_path, tiny_captioner), "test")
    config = validate_config(raw_config(tmp_path, tiny_model, tmp_path, tmp_path, tiny_captioner), "test")
    assert config.preprocess.missing_caption == "generate"  # settled by the caption section
    assert config_stages(config) == ("preprocess", "caption", *STAGES[1:])
    explicit = raw_config(tmp_path, tiny_model, tmp_path, tmp_path, tiny_captioner) | {
        "preprocess": {"missing_caption": "skip"}}
    assert validate_config(explicit, "test").preprocess.missing_caption == "skip"


def test_without_a_caption_section_nothing_changes(tmp_path, tiny_model):
    config = validate_config(raw_config(tmp_path, tiny_model, tmp_path, tmp_path, None), "test")
    assert config_stages(config) == STAGES and "caption" not in config.model_dump()
    assert config.preprocess.missing_caption == "error"
    source = DatasetSource(path=tmp_path)
    assert "caption_policy" not in source.model_dump() and "caption_text" not in source.model_dump()
    tagged = DatasetSource(path=tmp_path, caption_policy="prefix", caption_text="lpdemo")
    assert dataset_ingredients((tagged,), config.preprocess, _NoFiles()) == \
        dataset_ingredients((source,), config.preprocess, _NoFiles())  # never in preprocess's key


class _NoFiles:
    """A stat cache for an empty folder's fingerprint."""

    def digest(self, path):
        raise AssertionError(path)


@pytest.mark.slow
def test_new_images_prompt_and_renames_cost_what_they_change(tmp_path, tiny_model, tiny_captioner, demo_images,
                                                              count_generated_rows):
    data = half_captioned(demo_images, tmp_path / "data")
    raw = raw_config(tmp_path, tiny_model, data, tmp_path / "cache", tiny_captioner)
    with count_generated_rows() as first:
        results = run_all(validate_config(raw, "test"), UPTO_CAPTION)
    assert first == {"calls": 2, "rows": 4}  # the four uncaptioned images, in batches of 2
    captions = captions_of(results)["samples"]
    assert {i for i, e in captions.items() if e["source"] == "generated"} == set(UNCAPTIONED)
    assert all(captions[i]["caption"] == captions[i]["generated"] for i in UNCAPTIONED)
    assert captions["astronaut"]["caption"] == (data / "astronaut.txt").read_text().strip()

    new_image(data, "new_a")
    new_image(data, "new_b", "coffee")
    with count_generated_rows() as added:
        results = run_all(validate_config(raw, "test"), UPTO_CAPTION)
    assert added["rows"] == 2 and statuses(results) == {"preprocess": "computed", "caption": "computed"}
    assert results["caption"].info["reused"] == 4

    (data / "rocket.jpg").rename(data / "renamed_rocket.jpg")
    with count_generated_rows() as renamed:
        results = run_all(validate_config(raw, "test"), UPTO_CAPTION)
    assert renamed["rows"] == 0
    assert captions_of(results)["samples"]["renamed_rocket"]["generated"] == captions["rocket"]["generated"]

    raw["caption"]["prompt"] = "List the objects in this image."
    with count_generated_rows() as prompted:
        results = run_all(validate_config(raw, "test"), UPTO_CAPTION)
    assert prompted["rows"] == 6 and statuses(results) == {"preprocess": "hit", "caption": "computed"}
    with count_generated_rows() as again:
        assert statuses(run_all(validate_config(raw, "test"), UPTO_CAPTION)) == {"preprocess": "hit", "caption": "hit"}
    assert again["rows"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy, text", [("replace", None), ("prefix", "lpdemo"), ("suffix", "lpdemo"),
                                          ("combine", None)])
def test_policies_give_their_captions_and_never_touch_the_users(tmp_path, tiny_model, tiny_captioner, demo_images,
                                                                 count_generated_rows, policy, text):
    data = half_captioned(demo_images, tmp_path / "data")
    before = files(data)
    entry = {"path": str(data), "caption_policy": policy, **({"caption_text": text} if text else {})}
    raw = raw_config(tmp_path, tiny_model, {"datasets": [entry]}, tmp_path / "cache", tiny_captioner)
    with count_generated_rows() as counts:
        results = run_all(validate_config(raw, "test"), UPTO_CAPTION)
    assert counts["rows"] == 8  # every image takes a generated caption under these policies
    assert files(data) == before  # not one byte of the user's files changed, none added
    captions = captions_of(results)["samples"]
    for sample_id, e in captions.items():
        written = (data / f"{sample_id}.txt").read_text().strip() if sample_id not in UNCAPTIONED else None
        assert e["written"] == written and e["generated"]
        combined = (f"{written}. {e['generated']}", "combine") if written else (e["generated"], "generated")
        expected = {"replace": (e["generated"], "replace"), "prefix": (f"lpdemo, {e['generated']}", "prefix"),
                    "suffix": (f"{e['generated']}, lpdemo", "suffix"), "combine": combined}[policy]
        assert (e["caption"], e["source"]) == expected
    dataset = json.loads((Path(results["caption"].path) / DATASET_FILE).read_text())["samples"]
    assert {s["id"]: s["caption"] for s in dataset} == {i: e["caption"] for i, e in captions.items()}
    assert not any("written" in s for s in dataset)  # preprocess's format, as encode reads it


@pytest.mark.slow
def test_a_new_generated_caption_encodes_one_text_record(tmp_path, tiny_model, tiny_captioner, demo_images,
                                                         count_encoder_rows, count_generated_rows):
    data = half_captioned(demo_images, tmp_path / "data")
    raw = raw_config(tmp_path, tiny_model, data, tmp_path / "cache", tiny_captioner)
    stages = ("preprocess", "caption", "encode")
    run_all(validate_config(raw, "test"), UPTO_CAPTION)
    with count_encoder_rows() as first:
        results = run_all(validate_config(raw, "test"), stages)
    assert len({e["caption"] for e in captions_of(results)["samples"].values()}) == 8
    assert first == {"vae": 8, "text": 9}  # 8 images, 8 distinct captions (4 generated) + the empty prompt
    assert statuses(results) == {"preprocess": "hit", "caption": "hit", "encode": "computed"}
    samples = json.loads((Path(results["encode"].path) / "samples.json").read_text())["samples"]
    generated = captions_of(results)["samples"]["rocket"]["caption"]
    assert generated in {s["caption"] for s in samples}  # encode read the caption stage's dataset.json

    new_image(data, "new_a")
    run_all(validate_config(raw, "test"), UPTO_CAPTION)
    with count_encoder_rows() as added:
        results = run_all(validate_config(raw, "test"), stages)
    assert added == {"vae": 1, "text": 1}
    ctx = Context(validate_config(raw, "test"))
    try:
        rows = explain(ctx, config_stages(ctx.config))
    finally:
        ctx.close()
    assert [r["stage"] for r in rows] == ["preprocess", "caption", "encode", "train", "evaluate"]
    assert [r["status"] for r in rows[:3]] == ["hit"] * 3


def test_an_unsupported_captioner_is_one_line(tmp_path, tiny_model, demo_images):
    data = half_captioned(demo_images, tmp_path / "data")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    for folder, problem in ((tmp_path / "bert", "is a bert model; lorapipe captions with Florence-2 or Qwen2-VL"),
                            (tiny_model / "unet", "is not a transformers model folder"),
                            (tmp_path / "absent", "is not a folder")):
        raw = raw_config(tmp_path, tiny_model, data, tmp_path / "cache", folder)
        with pytest.raises(UserError, match=rf"^caption\.model: {folder} {problem}"):
            run_all(validate_config(raw, "test"), UPTO_CAPTION)


KILLED_RUN = """import json, sys
from lorapipe.flows.config import validate_config
from lorapipe.flows.steps import Context
from lorapipe.flows.runner import run_stage
ctx = Context(validate_config(json.loads(sys.argv[1]), "test"), log=lambda line: None)
upstream = {}
for stage in ("preprocess", "caption"):
    upstream[stage] = run_stage(ctx, stage, upstream)[1]
"""


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_killed_caption_stage_keeps_its_shards(tmp_path, tiny_model, tiny_captioner, demo_images,
                                                 count_generated_rows, processes):
    """kill -9 mid-way, of the stage's one process or of the stage and its two processes under
    accelerate launch: the committed shards stay, the rerun generates only the rest; the artifact
    refers to its shards (so `cache gc` keeps them)."""
    data = half_captioned(demo_images, tmp_path / "data")
    for photo in sorted(demo_images.glob("*.jpg")):
        for turn, name in ((Image.FLIP_LEFT_RIGHT, "mirrored"), (Image.ROTATE_180, "turned")):
            with Image.open(photo) as im:
                im.transpose(turn).save(data / f"{photo.stem}_{name}.jpg", quality=90)
    raw = raw_config(tmp_path, tiny_model, data, tmp_path / "cache", tiny_captioner, max_new_tokens=24,
                     num_processes=processes)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN, json.dumps(raw)], env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = tmp_path / "cache" / "samples"
    deadline = time.time() + 300
    while not list(shards.glob("*.json")):
        assert run.poll() is None, "the caption stage ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    committed = len(list(shards.glob("*.json")))
    assert not list((tmp_path / "cache" / "caption").glob("*/manifest.json"))  # nothing published
    with count_generated_rows() as rerun:
        results = run_all(validate_config(raw, "test"), UPTO_CAPTION)
    generated = rerun["rows"] if processes == 1 else results["caption"].info["generated"]  # counted in this process
    assert 0 < generated == 20 - 2 * committed  # 4 + 16 new images, 2 a shard
    assert results["caption"].info["reused"] == 2 * committed
    manifest = json.loads((Path(results["caption"].path) / "manifest.json").read_text())
    assert {Path(rel).stem for rel in manifest["refs"]} == {p.stem for p in shards.glob("*.json")}


def test_the_caption_demo_captions_the_photos_without_their_captions(tmp_path):
    from lorapipe.flows.config import load_config
    from lorapipe.flows.demo import prepare_demo

    config = load_config(prepare_demo(tmp_path, "sd15", caption=True))
    assert config.caption.model == tmp_path / "captioner" and config.data.path == tmp_path / "uncaptioned"
    assert sorted(p.suffix for p in config.data.path.iterdir()) == [".jpg"] * 8
    assert config_stages(config) == ("preprocess", "caption", *STAGES[1:])


@pytest.mark.slow
def test_a_damaged_caption_record_is_generated_again(tmp_path, tiny_model, tiny_captioner, demo_images,
                                                      count_generated_rows):
    from lorapipe.cache.object_store import open_sample_store

    data = half_captioned(demo_images, tmp_path / "data")
    config = validate_config(raw_config(tmp_path, tiny_model, data, tmp_path / "cache", tiny_captioner), "test")
    before = captions_of(run_all(config, UPTO_CAPTION))["samples"]
    store = open_sample_store(tmp_path / "cache")
    location = store.index()[before["rocket"]["record"]]
    offset, size, _ = location.members["json"]
    shard = store.shard_path(location.shard)
    damaged = bytearray(shard.read_bytes())
    damaged[offset + size // 2] ^= 0x01  # the shard keeps its size: only the record's digest tells
    shard.write_bytes(bytes(damaged))
    lines = []
    with count_generated_rows() as again:
        result = caption_again(config, lines.append)
    assert again["rows"] == 2  # the damaged shard's two records
    assert any("dropping the shard and generating its captions again" in line for line in lines)
    assert json.loads((Path(result.path) / CAPTIONS_FILE).read_text())["samples"] == before


@pytest.mark.slow
def test_the_caption_demo_runs_through_the_flow_and_then_from_the_cache(tmp_path):
    """`lorapipe demo --caption`: the caption stage as a Prefect task between preprocess and encode;
    the rerun serves every stage, caption too, from the cache."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    summaries, printed = [], []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "demo", "--caption", "--workdir", "run",
                               *FEWER_STEPS],
                              cwd=tmp_path, env=env, text=True, capture_output=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        printed.append(done.stdout)
        summaries.append(json.loads((tmp_path / "run" / "outputs" / "run-summary.json").read_text())["stages"])
    first, second = ([(r["stage"], r["status"]) for r in rows] for rows in summaries)
    assert first == [(stage, "computed") for stage in ("preprocess", "caption", *STAGES[1:])]
    assert second == [(stage, "hit") for stage, _ in first]
    assert summaries[0][1]["prefect_state"] == "Completed" and summaries[0][1]["info"]["generated"] == 8
    assert "captions generated 8, reused 0" in printed[0]
    outputs = tmp_path / "run" / "outputs"
    assert "dataset review:" in printed[0] and "<img" in (outputs / "logs" / "review.html").read_text()
    export = [sys.executable, "-m", "lorapipe.flows.cli", "captions", "export", "run/demo.yaml", "--json"]
    done = subprocess.run(export, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = {Path(p).name: Path(p).read_text() for p in json.loads(done.stdout)["written"]}
    generated = json.loads(next((tmp_path / "run" / "cache" / "caption").glob(f"*/{CAPTIONS_FILE}")).read_text())
    assert written == {f"{i}.txt": e["generated"] + "\n" for i, e in generated["samples"].items()}  # a sidecar each


def test_a_second_export_finds_the_captions_its_first_made_written_captions(tmp_path, tiny_model, tiny_captioner,
                                                                            demo_images, capsys):
    """The first export's sidecars change the data (preprocess's key), so the captions are no longer
    the current config's: the second export finds those of the pipeline's last run, writes nothing,
    leaves every file as it was, and says why it skipped each."""
    import yaml

    from lorapipe.flows.cli import main

    data = half_captioned(demo_images, tmp_path / "data")
    raw = raw_config(tmp_path, tiny_model, data, tmp_path / "cache", tiny_captioner)
    run_all(validate_config(raw, "test"), UPTO_CAPTION)
    config_path = tmp_path / "t.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    assert main(["captions", "export", str(config_path)]) == 0
    assert capsys.readouterr().out.endswith(f"{len(UNCAPTIONED)} caption file(s) written, 0 skipped\n")
    first = files(data)
    assert main(["captions", "export", str(config_path)]) == 0
    printed = capsys.readouterr()
    assert files(data) == first
    assert printed.out.splitlines()[-1] == (f"0 caption file(s) written, {len(UNCAPTIONED)} skipped"
                                            f" (already holds this caption: {len(UNCAPTIONED)})")
    assert "the data changed since its captions were made (preprocess: " in printed.err  # why the last run's


def test_a_qwen_processor_that_needs_torchvision_is_one_line(tmp_path, tiny_captioner):
    """transformers' own Qwen2.5-VL processor builds a video processor that needs torchvision, even
    for images (the tiny captioner's PaddleOCRVLProcessor does not)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor loads")
    folder = Path(shutil.copytree(tiny_captioner, tmp_path / "qwen"))
    config = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**config, "processor_class": "Qwen2_5_VLProcessor"}))
    video = {k: v for k, v in config["image_processor"].items() if k != "image_processor_type"}
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    with pytest.raises(UserError, match=rf"^caption\.model: {folder}: its processor cannot be loaded: .*Torchvision"
                                        r".*\(pip install torchvision\)$"):
        load_captioner(folder, CaptionParams(), "cpu", torch.float32)


def undecodable_jpeg(photo: Path) -> None:
    """Make `photo` (a baseline JPEG) name a quantisation table it does not define: its header and
    end marker are whole (preprocess, which reads those, takes it), its pixels cannot be decoded."""
    data = bytearray(photo.read_bytes())
    first_component = data.find(b"\xff\xc0") + 10  # SOF0: length, precision, height, width, components
    data[first_component + 2] = 3  # its table selector: table 3, which no DQT segment defines
    photo.write_bytes(bytes(data))


@pytest.mark.slow
def test_an_image_that_cannot_be_read_is_left_to_encode(tmp_path, tiny_model, tiny_captioner, demo_images,
                                                        count_generated_rows):
    """A JPEG that cannot be decoded, and one truncated after preprocess ran, stop nothing: the
    caption stage leaves them out of captioning with a report row each (in logs/report.json and the
    review) and keeps their samples, which encode reports as it does without a caption stage and
    trains without."""
    data = half_captioned(demo_images, tmp_path / "data")
    undecodable_jpeg(data / "retina.jpg")
    lines = []
    ctx = Context(validate_config(raw_config(tmp_path, tiny_model, data, tmp_path / "cache", tiny_captioner), "test"),
                  log=lines.append)
    try:
        preprocessed, pre = run_stage(ctx, "preprocess", {})
        jpeg = (data / "rocket.jpg").read_bytes()
        (data / "rocket.jpg").write_bytes(jpeg[: len(jpeg) // 3])
        with count_generated_rows() as counts:
            result, captioned = run_stage(ctx, "caption", {"preprocess": pre})
        encoded = run_stage(ctx, "encode", {"preprocess": pre, "caption": captioned})[0]
    finally:
        ctx.close()
    assert counts["rows"] == 2 and result.info["generated"] == 2 and result.info["left_out"] == 2
    rows = {w["path"]: w for w in json.loads((Path(result.path) / "logs" / "report.json").read_text())["warnings"]}
    assert rows["retina.jpg"]["reason"] == "undecodable" and "cannot be decoded" in rows["retina.jpg"]["detail"]
    assert rows["rocket.jpg"] == {"path": "rocket.jpg", "reason": "changed",
                                  "detail": "changed since preprocess ran (run the pipeline again)"}
    assert any(line.startswith("caption: retina.jpg: cannot be decoded") for line in lines)
    captions = json.loads((Path(result.path) / CAPTIONS_FILE).read_text())["samples"]
    assert {i: (e["caption"], e["source"], e["record"]) for i, e in captions.items() if e["source"] == "left_out"} == {
        "retina": ("", "left_out", captions["retina"]["record"]), "rocket": ("", "left_out", captions["rocket"]["record"])}
    review = (Path(result.path) / "logs" / "review.md").read_text()
    assert "retina.jpg" in review and "undecodable" in review
    assert set(json.loads((Path(encoded.path) / "logs" / "report.json").read_text())["undecodable"]) == {
        "retina.jpg", "rocket.jpg"}
    assert encoded.info["undecodable"] == 2 and encoded.info["latents_encoded"] == 6
    report_md = published_report(tmp_path, [with_files(preprocessed, pre), with_files(result, captioned)])
    assert "- `retina.jpg`: undecodable (" in report_md and "- `rocket.jpg`: changed (" in report_md  # caption's rows
