"""Edit pairs: which reference images belong to which target (control_dir, metadata reference
columns), every unusable reference a report row naming the file and line, and the per-record
invalidation counts on the tiny Flux.2-klein, through the real preprocess and encode stages, encodes
counted by forward hooks on the VAE encoder and on Qwen3 (one row per caption); and on the tiny
Qwen-Image-Edit, whose vision-language text encoder reads the references."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image, ImageOps
from conftest import EncodedSet
from invalidation_checks import ENCODE, encode_counted
from parallel import trained_ahead
from test_invalidation import make_config, run_all
from test_train_adapters import published, train_straight_and_resumed
from test_preprocess import image, preprocess

from lorapipe.flows.outputs import finish_run, with_files
from lorapipe.flows.steps import Context
from lorapipe.flows.runner import run_stage
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.evaluate.edits import EditPair, write_edit_grid
from lorapipe.stages.evaluate.render import HEADER_HEIGHT, LABEL_WIDTH
from lorapipe.stages.preprocess import DatasetSource

TARGETS = ("astronaut", "camera", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry", "retina",
           "rocket")
SHARED = ("astronaut", "camera")  # these two targets name one reference file


def rows(data: Path) -> list[dict]:
    return [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]


def write_rows(data: Path, table: list[dict]) -> None:
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table))


def edit_dataset(root: Path, demo_images: Path) -> Path:
    """The demo photos as targets, each with a mirrored grey reference in refs/ named by a metadata
    row (the SHARED targets name the same one), captions as instructions."""
    data = root / "data"
    (data / "refs").mkdir(parents=True)
    table = []
    for name in TARGETS:
        shutil.copy(demo_images / f"{name}.jpg", data / f"{name}.jpg")
        reference = "refs/shared.png" if name in SHARED else f"refs/{name}.png"
        if not (data / reference).exists():
            with Image.open(demo_images / f"{name}.jpg") as im:
                ImageOps.mirror(ImageOps.grayscale(im)).convert("RGB").resize((96, 80)).save(data / reference)
        table.append({"file_name": f"{name}.jpg", "text": f"make the {name.replace('_', ' ')} colourful",
                      "reference": reference})
    write_rows(data, table)
    return data


def pairs_config(root: Path, model: Path, data: Path, cache: Path):
    return make_config(root, model, {"datasets": [{"path": data, "reference_columns": ["reference"]}]}, cache)


# ---- which references, and what is refused


def test_control_dir_pairs_by_stem_and_each_bad_reference_is_a_report_row(tmp_path):
    data = tmp_path / "data"
    for shade, name in enumerate(("a", "b", "c", "d", "sub/e")):  # distinct bytes: no duplicates
        image(data / f"{name}.png", caption=f"edit {name}", color=(40 * shade, 0, 0))
    for name in ("a", "b", "sub/e"):
        image(data / "control" / f"{name}.png", size=(80, 80), caption=None)
    image(data / "control" / "b.jpg", caption=None)  # a second control image of stem b
    (data / "control" / "c.png").write_bytes(b"not a png")
    samples, report, _, _ = preprocess(DatasetSource(path=data, control_dir="control"), tmp_path, holdout_fraction=0)
    assert {s["path"]: [r["path"] for r in s["references"]] for s in samples} == {
        "a.png": ["control/a.png"], "sub/e.png": ["control/sub/e.png"]}
    assert {r["path"]: r["reason"] for r in report["rejected"]} == {
        "b.png": "ambiguous_reference", "c.png": "bad_reference", "d.png": "missing_reference"}
    details = {r["path"]: r["detail"] for r in report["rejected"]}
    assert "control/b.jpg and control/b.png" in details["b.png"] and "control/c.png" in details["c.png"]
    reference = samples[0]["references"][0]  # 80x80 covers the 64x64 bucket of its 96x64 target
    assert (reference["resized"], reference["crop_box"], samples[0]["size"]) == ([64, 64], [0, 0, 64, 64], [64, 64])


def test_metadata_reference_columns_name_files_and_lines_of_bad_rows(tmp_path, demo_images):
    data = edit_dataset(tmp_path, demo_images)
    (tmp_path / "outside.png").write_bytes((data / "refs" / "coffee.png").read_bytes())
    table = rows(data)
    table[2]["reference"] = "../outside.png"
    table[3]["reference"] = "refs/nothing.png"
    table[4]["reference"] = 7
    table[5]["reference"] = ["refs/retina.png", "refs/rocket.png"]
    write_rows(data, table)
    for orphan in ("chelsea", "coffee", "hubble_deep_field", "immunohistochemistry"):  # else targets themselves
        (data / "refs" / f"{orphan}.png").unlink()
    samples, report, _, _ = preprocess(DatasetSource(path=data, reference_columns=("reference",)), tmp_path,
                                       holdout_fraction=0)
    rejected = {r["path"]: (r["reason"], r["detail"]) for r in report["rejected"]}
    assert {path: reason for path, (reason, _) in rejected.items()} == {
        "chelsea.jpg": "outside_dataset", "coffee.jpg": "missing_reference", "hubble_deep_field.jpg": "bad_reference"}
    assert all(detail.startswith(f"metadata.jsonl:{line}:") for line, (_, detail) in
               zip((3, 4, 5), (rejected[p] for p in ("chelsea.jpg", "coffee.jpg", "hubble_deep_field.jpg"))))
    by_path = {s["path"]: [r["path"] for r in s["references"]] for s in samples}
    assert by_path["immunohistochemistry.jpg"] == ["refs/retina.png", "refs/rocket.png"]
    assert by_path["astronaut.jpg"] == by_path["camera.jpg"] == ["refs/shared.png"]
    assert not any(path.startswith("refs/") for path in by_path)  # a reference is no target


def test_control_dir_and_reference_columns_together_as_the_docs_show(tmp_path):
    """docs/data.md's example: control/a.png and a row naming r1.png, r2.png pair a.jpg; either
    source alone pairs a target, and a file a row names is no target."""
    data = tmp_path / "pairs"
    for shade, name in enumerate(("a", "b", "c", "d", "e")):
        image(data / f"{name}.jpg", caption=None, color=(40 * shade, 0, 0))
    for shade, name in enumerate(("control/a", "control/b", "r1", "r2", "refs/shared")):
        image(data / f"{name}.png", size=(80, 80), caption=None, color=(0, 40 * shade, 0))
    write_rows(data, [{"file_name": "a.jpg", "text": "edit a", "reference": ["r1.png", "r2.png"]},
                      {"file_name": "b.jpg", "text": "edit b"},  # its control image only
                      {"file_name": "c.jpg", "text": "edit c", "reference": "refs/shared.png"},  # no control image
                      {"file_name": "d.jpg", "text": "edit d", "reference": ["refs/shared.png"]},
                      {"file_name": "e.jpg", "text": "edit e"}])  # neither
    source = DatasetSource(path=data, control_dir="control", reference_columns=("reference",))
    samples, report, _, _ = preprocess(source, tmp_path, holdout_fraction=0)
    assert {s["path"]: [r["path"] for r in s["references"]] for s in samples} == {
        "a.jpg": ["control/a.png", "r1.png", "r2.png"], "b.jpg": ["control/b.png"],
        "c.jpg": ["refs/shared.png"], "d.jpg": ["refs/shared.png"]}
    assert [(r["path"], r["reason"]) for r in report["rejected"]] == [("e.jpg", "missing_reference")]
    assert "control/e.*" in report["rejected"][0]["detail"] and "metadata.jsonl:5" in report["rejected"][0]["detail"]


def test_a_row_without_the_reference_column_is_a_missing_reference(tmp_path, demo_images):
    data = edit_dataset(tmp_path, demo_images)
    table = rows(data)
    del table[6]["reference"]  # retina.jpg's row names no reference
    table[7]["reference"] = None  # nor does rocket.jpg's
    write_rows(data, table)
    for orphan in ("retina", "rocket"):
        (data / "refs" / f"{orphan}.png").unlink()
    _, report, _, _ = preprocess(DatasetSource(path=data, reference_columns=("reference",)), tmp_path,
                                 holdout_fraction=0)
    assert {r["path"]: (r["reason"], r["detail"]) for r in report["rejected"]} == {
        "retina.jpg": ("missing_reference", "metadata.jsonl:7: no reference column"),
        "rocket.jpg": ("missing_reference", "metadata.jsonl:8: no reference column")}


def test_more_references_than_the_model_takes_are_refused_per_target_at_preprocess(tmp_path, demo_images,
                                                                                   flux_kontext_model):
    """Flux.1 Kontext reads one reference: a row naming two refuses its target alone, naming it,
    before anything is encoded (the bound comes from the model's family); the run publishes the
    rejected rows to its output folder."""
    data = edit_dataset(tmp_path, demo_images)
    table = rows(data)
    table[5]["reference"] = ["refs/immunohistochemistry.png", "refs/retina.png"]
    write_rows(data, table)
    cfg = pairs_config(tmp_path, flux_kontext_model, data, tmp_path / "cache")
    ctx = Context(cfg, log=lambda line: None)
    try:
        result, pre = run_stage(ctx, "preprocess", {})
    finally:
        ctx.close()
    finish_run(cfg.output_dir, cfg, [with_files(result, pre)], "run", lambda line: None, record=False)
    published = json.loads((cfg.output_dir / "rejected.json").read_text())
    assert published["rejected"] == [{"path": "immunohistochemistry.jpg", "reason": "too_many_references", "detail":
                                      "2 references (refs/immunohistochemistry.png, refs/retina.png), but the"
                                      " model takes at most 1"}]
    assert published["counts"] == {"too_many_references": 1}
    samples = json.loads((pre.path / "dataset.json").read_text())["samples"]
    assert len(samples) == len(TARGETS) - 1 and all(len(s["references"]) == 1 for s in samples)


def test_each_edit_grid_row_is_titled_with_its_target_file(tmp_path):
    """Rows of one instruction and seed differ only by their title: the pair's target file."""
    def pair(name: str) -> EditPair:
        return EditPair("add a hat", [Image.new("RGB", (64, 64), "grey")], Image.new("RGB", (64, 64), "red"), name)

    pairs = [pair("a.jpg"), pair("sub/b.jpg"), pair("a.jpg")]
    write_edit_grid(tmp_path / "edit_grid.png", pairs, [0], {"base": [p.target for p in pairs]}, 64)
    with Image.open(tmp_path / "edit_grid.png") as grid:
        titles = [grid.crop((0, HEADER_HEIGHT + r * 64, LABEL_WIDTH, HEADER_HEIGHT + r * 64 + 14)).tobytes()
                  for r in range(3)]
    assert titles[0] == titles[2] != titles[1]


def test_reference_settings_are_refused_in_one_line_where_they_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="control_dir '../elsewhere' must name a folder inside the dataset"):
        DatasetSource(path=tmp_path, control_dir="../elsewhere")
    with pytest.raises(ValueError, match="need the folder format"):
        DatasetSource(path=tmp_path, format="parquet", reference_columns=("reference",))


# ---- invalidation with counts (Flux.2-klein reads references as latents only)

IMAGES = len(TARGETS) + len(TARGETS) - 1  # targets, and their references less the one shared
CAPTIONS = len(TARGETS) + 1  # and the empty prompt


@pytest.fixture(scope="module")
def edit_baseline(tmp_path_factory, flux2_model, demo_images, count_encoder_rows):
    """One encoded edit set on the tiny Flux.2-klein; tests start from copies of its data over its cache."""
    root = tmp_path_factory.mktemp("edit-baseline")
    data = edit_dataset(root, demo_images)
    results, counts = encode_counted(pairs_config(root, flux2_model, data, root / "cache"), count_encoder_rows)
    assert counts == {"vae": IMAGES, "text": CAPTIONS}
    assert results["encode"].info["latents_encoded"] == IMAGES
    return root, flux2_model


def encoded_set(edit_baseline, tmp_path: Path) -> EncodedSet:
    """The baseline's encode artifact (a hit: nothing is encoded again)."""
    config, _ = baseline_copy(edit_baseline, tmp_path)
    results = run_all(config, ENCODE)
    return EncodedSet(Path(results["encode"].path), Path(config.cache_dir), results["encode"].digest)


def baseline_copy(edit_baseline, tmp_path: Path):
    root, model = edit_baseline
    shutil.copytree(root / "data", tmp_path / "data")
    return pairs_config(tmp_path, model, tmp_path / "data", root / "cache"), tmp_path / "data"


@pytest.mark.slow
def test_shared_reference_is_one_record_and_pairs_reach_the_encoded_samples(edit_baseline, tmp_path,
                                                                           count_encoder_rows):
    config, _ = baseline_copy(edit_baseline, tmp_path)
    results, counts = encode_counted(config, count_encoder_rows)
    assert results["encode"].status == "hit" and counts == {"vae": 0, "text": 0}
    encoded = EncodedData(Path(results["encode"].path), config.cache_dir)
    by_id = {s.id: s for s in encoded.samples}
    assert by_id["astronaut"].references == by_id["camera"].references
    assert len({s.references[0].key for s in encoded.samples}) == len(TARGETS) - 1
    target = encoded.normalisation.apply(encoded.latent(by_id["coffee"])[0].float().unsqueeze(0))
    assert encoded.reference_latents(by_id["coffee"]).shape == target.shape  # normalised as its target is


@pytest.mark.slow
def test_swapping_one_reference_encodes_that_reference_alone(edit_baseline, tmp_path, count_encoder_rows):
    config, data = baseline_copy(edit_baseline, tmp_path)
    with Image.open(data / "refs" / "coffee.png") as im:
        ImageOps.invert(im).save(data / "refs" / "coffee.png")
    results, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": 1, "text": 0}
    assert results["encode"].info["latents_reused"] == IMAGES - 1


@pytest.mark.slow
def test_a_second_reference_on_one_row_encodes_only_that_reference(edit_baseline, tmp_path, count_encoder_rows):
    config, data = baseline_copy(edit_baseline, tmp_path)
    image(data / "refs" / "extra.png", size=(64, 64), caption=None, color=(10, 200, 10))
    table = rows(data)
    table[3]["reference"] = [table[3]["reference"], "refs/extra.png"]
    write_rows(data, table)
    results, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": 1, "text": 0}
    encoded = EncodedData(Path(results["encode"].path), config.cache_dir)
    assert [len(s.references) for s in encoded.samples].count(2) == 1


@pytest.mark.slow
def test_a_target_caption_edit_encodes_one_text_record(edit_baseline, tmp_path, count_encoder_rows):
    config, data = baseline_copy(edit_baseline, tmp_path)
    table = rows(data)
    table[0]["text"] = "make the astronaut wear a red hat"
    write_rows(data, table)
    results, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": 0, "text": 1}
    assert results["encode"].info["texts_encoded"] == 1



@pytest.mark.slow
def test_training_on_edit_pairs_resumes_exactly(edit_baseline, tmp_path):
    """The real train stage on the pairs: a run resumed from its halfway checkpoint publishes the same
    files, byte for byte, as one that ran straight."""
    with trained_ahead() as warm:  # both in one process started ahead, which trains as its own would
        run = train_straight_and_resumed(tmp_path, edit_baseline[1], encoded_set(edit_baseline, tmp_path),
                                         {"ema_decay": None}, warm)
    files = published(run.straight)
    assert "pytorch_lora_weights.safetensors" in files and published(run.resumed) == files


@pytest.fixture(scope="module")
def qwen_edit_baseline(tmp_path_factory, qwenimage_edit_model, demo_images, count_encoder_rows):
    """The pairs encoded by the tiny Qwen-Image-Edit: each target's caption is read with its reference,
    and so is each pair's own empty prompt (caption dropout), one per distinct reference."""
    root = tmp_path_factory.mktemp("qwen-edit-baseline")
    data = edit_dataset(root, demo_images)
    _, counts = encode_counted(pairs_config(root, qwenimage_edit_model, data, root / "cache"), count_encoder_rows)
    assert counts == {"vae": IMAGES, "text": len(TARGETS) + len(TARGETS) - 1}
    return root, qwenimage_edit_model


@pytest.mark.slow
def test_swapping_a_reference_a_vl_encoder_reads_encodes_its_latent_and_its_pairs_texts(qwen_edit_baseline, tmp_path,
                                                                                      count_encoder_rows):
    config, data = baseline_copy(qwen_edit_baseline, tmp_path)
    with Image.open(data / "refs" / "coffee.png") as im:
        ImageOps.invert(im).save(data / "refs" / "coffee.png")
    results, counts = encode_counted(config, count_encoder_rows)
    assert counts == {"vae": 1, "text": 2}  # coffee's instruction and its empty prompt, read with the new reference
    assert results["encode"].info["latents_reused"] == IMAGES - 1
