"""Caption augmentation with cached text embeddings (encode.caption_variants, shuffle_tags,
keep_tokens, tag_dropout): the variants are deterministic in any process; on the tiny SD1.x through
the real preprocess and encode stages (encodes counted by forward hooks) each training sample gets
its K text records, a caption edit re-encodes that sample's K and nothing else, a new tag_dropout
re-encodes text and no latent, and the defaults keep today's keys; the batch plan shows every
variant of a sample once per K draws, and training over the variants resumes exactly."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from parallel import trained_ahead
from test_invalidation import make_config, run_all, statuses

from lorapipe.flows.config import validate_config
from lorapipe.flows.steps import STAGES, Context
from lorapipe.flows.runner import explain
from lorapipe.stages.encode import EncodeParams, SampleKeys
from lorapipe.stages.encode.captions import CaptionAugmentation
from lorapipe.stages.preprocess.rows import SampleRow

ENCODE = STAGES[:2]
TAGS = {  # the demo photos, captioned as tags; the first is a trigger word that keep_tokens holds in place
    "astronaut": "lpdemo, astronaut, white spacesuit, american flag, smiling, studio portrait",
    "camera": "lpdemo, man, camera, tripod, black and white, grass field",
    "chelsea": "lpdemo, tabby cat, looking aside, whiskers, indoors, close-up",
    "coffee": "lpdemo, coffee cup, saucer, spoon, table, top view",
    "hubble_deep_field": "lpdemo, galaxies, deep space, stars, telescope image, dark background",
    "immunohistochemistry": "lpdemo, microscope image, stained tissue, purple, brown, cells",
    "retina": "lpdemo, retina, blood vessels, medical photo, orange, round",
    "rocket": "lpdemo, rocket, launch pad, tower, blue sky, smoke",
}
VARIANTS = {"caption_variants": 3, "shuffle_tags": True, "keep_tokens": 1, "tag_dropout": 0.1}


def test_variants_keep_the_first_tags_and_are_the_same_in_every_process():
    settings = CaptionAugmentation(**VARIANTS)
    caption, digest = TAGS["rocket"], "0123abcd"
    variants = tuple(settings.captions(caption, digest))
    assert len(variants) == 3 and len(set(variants)) == 3
    assert all(v.startswith("lpdemo, ") and set(v.split(", ")) <= set(caption.split(", ")) for v in variants)
    assert tuple(settings.captions(caption, "another image")) != variants  # seeded by the image, not the caption alone
    code = ("import json, sys; from lorapipe.stages.encode.captions import CaptionAugmentation as C;"
            f"print(json.dumps(list(C(**{VARIANTS!r}).captions({caption!r}, {digest!r}))))")
    for hash_seed in ("1", "2"):  # Python's str hash differs between these processes
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(Path(__file__).parent.parent)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert tuple(json.loads(out.stdout)) == variants


def test_tag_dropout_drops_about_that_share_of_the_unkept_tags():
    settings = CaptionAugmentation(caption_variants=20, tag_dropout=0.25, keep_tokens=2)
    caption = ", ".join(f"tag{i}" for i in range(12))
    variants = [v for image in range(50) for v in settings.captions(caption, f"image{image}")]
    kept = sum(len(v.split(", ")) - 2 for v in variants) / (len(variants) * 10)
    assert 0.72 < kept < 0.78, kept
    assert all(v.split(", ")[:2] == ["tag0", "tag1"] for v in variants)  # keep_tokens: never dropped
    assert all(v.split(", ") == sorted(v.split(", "), key=lambda t: int(t[3:])) for v in variants)  # not shuffled


def test_settings_that_would_change_nothing_or_be_fixed_forever_are_refused():
    with pytest.raises(ValueError, match="caption_variants: 3 would be identical captions"):
        EncodeParams(caption_variants=3)
    with pytest.raises(ValueError, match="set caption_variants"):
        EncodeParams(shuffle_tags=True)
    with pytest.raises(ValueError, match="keep_tokens keeps"):
        EncodeParams(keep_tokens=1)
    with pytest.raises(ValueError, match=r"^demo.yaml: encode: .*caption_variants: 2 would be identical captions"):
        validate_config({"cache_dir": "c", "output_dir": "o", "model": {"path": "m"}, "data": {"path": "d"},
                         "encode": {"caption_variants": 2}, "train": {}, "evaluate": {}}, "demo.yaml")
    assert EncodeParams().model_dump() == EncodeParams(caption_variants=1, tag_dropout=0.0).model_dump()
    assert not any("caption" in k or "tag" in k for k in EncodeParams().model_dump())  # encode's key as before


def test_caption_variants_has_an_upper_bound():
    """100,000,000 variants was accepted, then encode computed keys for over ten minutes, silently."""
    with pytest.raises(ValueError, match=r"^demo.yaml: encode.caption_variants: Input should be less than or equal"
                                         r" to 64$"):
        validate_config({"cache_dir": "c", "output_dir": "o", "model": {"path": "m"}, "data": {"path": "d"},
                         "encode": {"caption_variants": 100_000_000, "shuffle_tags": True}, "train": {},
                         "evaluate": {"prompts": ["x"]}}, "demo.yaml")
    assert EncodeParams(caption_variants=64, shuffle_tags=True).caption_variants == 64


def test_keying_many_variants_shows_progress_as_it_goes():
    """Variants are made and keyed one sample at a time, each sample a step of the progress lines
    (shown once keying takes `every` seconds; here at once)."""
    params = EncodeParams(caption_variants=64, shuffle_tags=True)
    dataset = [SampleRow(id=f"s{i}", source=0, path=f"s{i}.png", digest=f"d{i}", caption=TAGS["rocket"], repeats=1,
                         split="train", original_size=(64, 64), size=(64, 64), resized=(64, 64), crop_box=(0, 0, 64, 64))
               for i in range(3)]
    lines: list[str] = []
    keys = SampleKeys.of(dataset, params, "vae", {"family": "sd"}, 8, lines.append, every=0)
    assert [line.split(" |")[0] for line in lines] == [f"encode: keying samples {i}/3" for i in (1, 2, 3)]
    assert all(len(keys.text[s.id]) == 64 for s in dataset)
    assert SampleKeys.of(dataset, params, "vae", {"family": "sd"}, 8, lines.append) == keys  # quick: no line
    assert len(lines) == 3


def samples_of(results: dict) -> list[dict]:
    """The samples of a run's encode artifact."""
    return json.loads((Path(results["encode"].path) / "samples.json").read_text())["samples"]


def captions_of(samples: list[dict]) -> set[str]:
    """Every caption an encode artifact's text records hold (the empty prompt's too)."""
    return {"", *(c for s in samples for c in s.get("caption_variants", [s["caption"]]))}


def tagged_copy(root: Path, tmp_path: Path, cache: Path | None = None, **encode):
    shutil.copytree(root / "model", tmp_path / "model")
    shutil.copytree(root / "data", tmp_path / "data")
    return make_config(tmp_path, tmp_path / "model", tmp_path / "data", cache or root / "cache",
                       encode={**VARIANTS, **encode})


@pytest.fixture(scope="module")
def variants_baseline(tmp_path_factory, tiny_model, demo_images, count_encoder_rows):
    """The demo photos captioned as tags, encoded as they were before caption variants existed,
    then with 3 variants per training sample. Tests start from copies over its cache."""
    root = tmp_path_factory.mktemp("variants")
    shutil.copytree(tiny_model, root / "model")
    shutil.copytree(demo_images, root / "data")
    for name, caption in TAGS.items():
        (root / "data" / f"{name}.txt").write_text(caption)
    plain = make_config(root, root / "model", root / "data", root / "cache")
    with count_encoder_rows() as counts:
        before = run_all(plain, ENCODE)
    assert counts == {"vae": 8, "text": 9}
    varied = make_config(root, root / "model", root / "data", root / "cache", encode=VARIANTS)
    with count_encoder_rows() as counts:
        after = run_all(varied, ENCODE)
    return root, before, after, counts


@pytest.mark.slow
def test_three_variants_encode_three_text_records_per_training_sample_and_no_latent(variants_baseline):
    _, before, after, counts = variants_baseline
    assert statuses(after) == {"preprocess": "hit", "encode": "computed"}
    samples = samples_of(after)
    train = [s for s in samples if s["split"] == "train"]
    assert len(train) == 6 and all(len(s["text_variants"]) == len(set(s["caption_variants"])) == 3 for s in train)
    assert all(s["text"] == s["text_variants"][0] for s in train)
    assert all("text_variants" not in s for s in samples if s["split"] == "holdout")  # scored as written
    assert all(c.startswith("lpdemo, ") for s in train for c in s["caption_variants"])  # keep_tokens: 1
    new = captions_of(samples) - captions_of(samples_of(before))
    assert len(new) == 18  # every variant differs from its caption as written: 18 new text records
    assert counts == {"vae": 0, "text": 18}
    assert after["encode"].info["texts_encoded"] == 18 and after["encode"].info["latents_encoded"] == 0


@pytest.mark.slow
def test_default_settings_keep_the_keys_an_existing_encoded_set_has(variants_baseline, tmp_path, count_encoder_rows):
    root, before, _, _ = variants_baseline
    config = tagged_copy(root, tmp_path, caption_variants=1, shuffle_tags=False, keep_tokens=0, tag_dropout=0.0)
    with count_encoder_rows() as counts:
        results = run_all(config, ENCODE)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit"} and counts == {"vae": 0, "text": 0}
    assert results["encode"].key == before["encode"].key and results["encode"].digest == before["encode"].digest


@pytest.mark.slow
def test_a_caption_edit_re_encodes_that_samples_variants_and_nothing_else(variants_baseline, tmp_path,
                                                                         count_encoder_rows):
    root, _, after, _ = variants_baseline
    config = tagged_copy(root, tmp_path)
    edited = next(s for s in samples_of(after) if s["split"] == "train" and s["caption"] == TAGS["coffee"])
    (tmp_path / "data" / "coffee.txt").write_text("lpdemo, espresso, saucer, spoon, table, top view")
    with count_encoder_rows() as counts:
        results = run_all(config, ENCODE)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 0, "text": 3}
    now = {s["latent"]: s for s in samples_of(results)}
    assert set(now[edited["latent"]]["text_variants"]).isdisjoint(edited["text_variants"])
    unchanged = [s for s in samples_of(after) if s["latent"] != edited["latent"]]
    assert all(now[s["latent"]].get("text_variants") == s.get("text_variants") for s in unchanged)


@pytest.mark.slow
def test_a_new_tag_dropout_re_encodes_text_records_only(variants_baseline, tmp_path, count_encoder_rows):
    root, _, after, _ = variants_baseline
    config = tagged_copy(root, tmp_path, tag_dropout=0.4)
    rows = {r["stage"]: r for r in explain(Context(config), ENCODE)}
    assert rows["encode"]["status"] == "miss" and "params.tag_dropout" in rows["encode"]["reason"]
    with count_encoder_rows() as counts:
        results = run_all(config, ENCODE)
    new = captions_of(samples_of(results)) - captions_of(samples_of(after))
    assert counts == {"vae": 0, "text": len(new)} and len(new) > 0
    assert [s["latent"] for s in samples_of(results)] == [s["latent"] for s in samples_of(after)]


@pytest.mark.slow
def test_a_rerun_encodes_the_same_variants(variants_baseline, tmp_path, count_encoder_rows):
    root, _, after, _ = variants_baseline
    config = tagged_copy(root, tmp_path, tmp_path / "fresh-cache")  # nothing cached: every record encoded again
    with count_encoder_rows() as counts:
        results = run_all(config, ENCODE)
    assert counts == {"vae": 8, "text": 18 + 2 + 1}  # the variants, the held-out captions, the empty prompt
    assert results["encode"].digest == after["encode"].digest  # same variants, same keys, same samples.json


@pytest.mark.slow
def test_the_batch_plan_shows_each_variant_once_in_every_k_draws_of_a_sample(variants_baseline):
    from dataclasses import replace

    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.train.data import BatchPlan

    root, _, after, _ = variants_baseline
    train = EncodedData(Path(after["encode"].path), root / "cache").split("train")
    plan = BatchPlan(train, seed=5, batch_size=1, num_processes=1)
    drawn: dict[str, list[str]] = {}  # each sample's text records, draw after draw (one per epoch)
    for m in range(6 * plan.batches_per_epoch):
        (sample,) = plan.batch(m, 0)
        drawn.setdefault(sample.id, []).append(sample.text.key)
    for sample in train:
        variants, seen = sorted(r.key for r in sample.text_variants), drawn[sample.id]
        assert sorted(seen[:3]) == variants and sorted(seen[3:]) == variants
    assert any(drawn[s.id][:3] != drawn[s.id][3:] for s in train)  # each run of 3 epochs in its own order
    again = BatchPlan(train, seed=5, batch_size=1, num_processes=1)
    assert [again.batch(m, 0)[0].text.key for m in range(18)] == [plan.batch(m, 0)[0].text.key for m in range(18)]
    repeated = BatchPlan([replace(train[0], repeats=3)], seed=5, batch_size=1, num_processes=1)
    one_epoch = [repeated.batch(m, 0)[0].text.key for m in range(3)]
    assert sorted(one_epoch) == sorted(r.key for r in train[0].text_variants)  # its copies draw different ones


@pytest.mark.slow
def test_training_over_variants_conditions_on_them_resumes_exactly_and_says_so_in_kohya_metadata(
        variants_baseline, tmp_path):
    from safetensors import safe_open

    from lorapipe.stages import train

    root, before, after, _ = variants_baseline

    def trained(name: str, encoded, steps: int, work: Path | None = None) -> list[tuple]:
        """(step, loss, lr) of each step, trained in the process started ahead"""
        inputs = train.TrainInputs(encoded_dir=Path(encoded.path), cache_root=root / "cache",
                                   model_path=root / "model", base_model_digest="base", encoded_digest=encoded.digest)
        params = train.TrainParams(rank=4, learning_rate=1e-2, batch_size=2, max_steps=steps, checkpoint_every=6,
                                   seed=3)
        out = tmp_path / f"out-{name}"
        out.mkdir()
        train.run(params, inputs, out, work or tmp_path / f"work-{name}", train.TrainOptions(log_with="none"),
                  log=lambda line: None, placement=warm)
        rows = [json.loads(line) for line in (out / "logs" / "loss.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["lr"]) for r in rows]

    # 3 batches an epoch: 4 epochs, past one run of 3; the same batches over the captions as written;
    # one process started ahead trains all three as a process of its own would (parallel.py)
    with trained_ahead() as warm:
        straight = trained("straight", after["encode"], 12)
        as_written = trained("as-written", before["encode"], 12)
        for left in ("checkpoints/step-000006", "logs"):  # what a run killed after step 6's checkpoint leaves
            shutil.copytree(tmp_path / "work-straight" / left, tmp_path / "work" / left)
        assert trained("resumed", after["encode"], 12, tmp_path / "work") == straight
    assert as_written != straight  # other captions

    def kohya(name: str) -> dict:
        with safe_open(tmp_path / f"out-{name}" / "pytorch_lora_weights_kohya.safetensors", "pt") as f:
            return f.metadata()

    assert {k: kohya("resumed")[k] for k in ("ss_shuffle_caption", "ss_keep_tokens", "ss_caption_tag_dropout_rate")
            } == {"ss_shuffle_caption": "True", "ss_keep_tokens": "1", "ss_caption_tag_dropout_rate": "0.1"}
    assert "ss_shuffle_caption" not in kohya("as-written")
