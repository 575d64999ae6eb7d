"""Each invalidation rule of the cache, proven on the tiny pipeline (CPU, real stages, no Prefect:
the flow only wraps these same calls in tasks). Encodes are counted by hooking the VAE encoder's
and text encoders' forward calls, not by trusting the stage's own counters."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from parallel import trained_ahead

from lorapipe.flows.config import validate_config
from lorapipe.flows.steps import STAGES, Context
from lorapipe.flows.runner import explain, run_stage
from lorapipe.stages.processes.placement import Placement

pytestmark = pytest.mark.slow

SMALL = {
    "preprocess": {"resolution": 64, "holdout_fraction": 0.25},
    "encode": {"num_workers": 2, "batch_size": 2, "shard_records": 3},  # decode threads ahead of the VAE
    "train": {"max_steps": 20, "learning_rate": 2e-3, "checkpoint_every": 10, "keep_checkpoints": 2, "log_every": 10},
    "evaluate": {"prompts": ["a photo of a cat"], "seeds": [0], "num_inference_steps": 2},
}


def make_config(tmp: Path, model: Path, data: Path | dict, cache: Path, **sections):
    """`data`: one folder, or the data section itself."""
    raw = {"name": "t", "cache_dir": cache, "output_dir": tmp / "out", "model": {"path": model},
           "data": data if isinstance(data, dict) else {"path": data},
           **{k: {**v, **sections.get(k, {})} for k, v in SMALL.items()}}
    return validate_config(raw, "test")


def run_all(config, stages=STAGES, log=lambda line: None, placements: dict[str, Placement] | None = None) -> dict:
    ctx = Context(config, log=log, placements=placements)
    upstream, results = {}, {}
    try:
        for stage in stages:
            results[stage], upstream[stage] = run_stage(ctx, stage, upstream)
    finally:
        ctx.close()
    return results


def statuses(results: dict) -> dict[str, str]:
    return {stage: r.status for stage, r in results.items()}


@pytest.fixture(scope="module")
def ahead():
    """The module's placements: training in one process started ahead, as `lorapipe run` hands its
    training to one (tests/test_train.py: it trains as a process of its own would), so the
    trainings here pay their imports once. A training that fails there ends it: later ones start
    processes of their own."""
    with trained_ahead() as placement:
        yield {"train": placement}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model, demo_images, count_encoder_rows, ahead):
    """One complete run; every test starts from copies of its model and data over its cache."""
    root = tmp_path_factory.mktemp("baseline")
    shutil.copytree(tiny_model, root / "model")
    shutil.copytree(demo_images, root / "data")
    config = make_config(root, root / "model", root / "data", root / "cache")
    with count_encoder_rows() as counts:
        encoded = run_all(config, STAGES[:2])
    assert counts == {"vae": 8, "text": 9}  # 8 images, 8 captions + the empty prompt
    results = run_all(config, placements=ahead)
    assert statuses(encoded) == {"preprocess": "computed", "encode": "computed"}
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed", "evaluate": "computed"}
    return root


def copy_of(baseline: Path, tmp_path: Path, cache: Path | None = None, **sections):
    shutil.copytree(baseline / "model", tmp_path / "model")
    shutil.copytree(baseline / "data", tmp_path / "data")
    return make_config(tmp_path, tmp_path / "model", tmp_path / "data", cache or baseline / "cache", **sections)


def test_unchanged_inputs_moved_and_touched_rerun_nothing(baseline, tmp_path, count_encoder_rows):
    config = copy_of(baseline, tmp_path)  # new folders, new inodes, same bytes
    for path in (tmp_path / "data").iterdir():
        os.utime(path, ns=(10**9, 10**9))
    with count_encoder_rows() as counts:
        results = run_all(config)
    assert statuses(results) == dict.fromkeys(STAGES, "hit")
    assert counts == {"vae": 0, "text": 0}


def test_learning_rate_reruns_only_train_and_evaluate(baseline, tmp_path, ahead):
    config = copy_of(baseline, tmp_path, train={"learning_rate": 1e-3})
    rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
    assert rows["train"]["status"] == "miss" and "params.learning_rate" in rows["train"]["reason"]
    results = run_all(config, placements=ahead)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed", "evaluate": "computed"}


def test_adapter_type_and_ema_rerun_train_and_evaluate_but_encode_nothing(baseline, tmp_path, count_encoder_rows,
                                                                          ahead):
    """A LoKr with an EMA: train and evaluate rerun, nothing is encoded; the run's checkpoints hold the
    EMA, and evaluate scores and renders it beside the trained adapter (one more grid column)."""
    from PIL import Image

    config = copy_of(baseline, tmp_path, train={"adapter": "lokr", "ema_decay": 0.9})
    rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
    assert rows["train"]["status"] == "miss" and "params.adapter" in rows["train"]["reason"]
    with count_encoder_rows() as counts:  # evaluate's renders encode their prompts: count the stages before
        encoded = run_all(config, STAGES[:2])
    assert statuses(encoded) == {"preprocess": "hit", "encode": "hit"} and counts == {"vae": 0, "text": 0}
    results = run_all(config, placements=ahead)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed", "evaluate": "computed"}
    trained, evaluated = Path(results["train"].path), Path(results["evaluate"].path)
    assert (trained / "ema" / "pytorch_lora_weights.safetensors").is_file()
    work = baseline / "cache" / "work" / "train"
    assert any(work.glob("*/checkpoints/step-000020/ema.safetensors"))
    metrics = json.loads((evaluated / "metrics.json").read_text())
    assert set(metrics["loss"]["holdout"]) == {"base", "lora", "ema"}
    assert metrics["loss"]["holdout"]["ema"] != metrics["loss"]["holdout"]["lora"]
    base_run = run_all(copy_of(baseline, tmp_path / "plain"))["evaluate"]
    widths = [Image.open(Path(r.path) / "grid.png").width for r in (base_run, results["evaluate"])]
    assert widths[1] > widths[0]  # base, LoRA x1, EMA x1


def test_evaluation_prompt_reruns_only_evaluate(baseline, tmp_path):
    config = copy_of(baseline, tmp_path, evaluate={"prompts": ["a photo of a rocket"]})
    results = run_all(config)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "hit", "evaluate": "computed"}
    assert "params.prompts" in results["evaluate"].reason


def test_one_caption_edit_encodes_one_text_embedding_and_no_latent(baseline, tmp_path, count_encoder_rows):
    from invalidation_checks import assert_caption_edit_encodes_one_text_record_and_no_latent

    assert_caption_edit_encodes_one_text_record_and_no_latent(copy_of(baseline, tmp_path), tmp_path / "data",
                                                              count_encoder_rows)


def test_new_vae_weights_at_the_same_path_re_encode_latents_but_no_text(baseline, tmp_path, count_encoder_rows):
    config = copy_of(baseline, tmp_path)
    weights = tmp_path / "model" / "vae" / "diffusion_pytorch_model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors = {k: v * 1.01 if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
    assert rows["encode"]["status"] == "miss" and "models.vae" in rows["encode"]["reason"]
    with count_encoder_rows() as counts:
        results = run_all(config, STAGES[:2])
    assert statuses(results) == {"preprocess": "hit", "encode": "computed"}
    assert counts == {"vae": 8, "text": 0}


def over_base(config, **components: Path | dict[str, Path]):
    """`config` with components set over its base model (model.unet, model.vae, model.text_encoders)."""
    return config.model_copy(update={"model": config.model.model_copy(update=components)})


def test_a_unet_over_the_base_folder_or_file_reruns_train_and_evaluate_and_encodes_nothing(
        baseline, tmp_path, count_encoder_rows, ahead):
    import torch
    from safetensors.torch import load_file
    from test_compose import perturbed_copy

    base = copy_of(baseline, tmp_path)
    same = shutil.copytree(tmp_path / "model" / "unet", tmp_path / "same-unet")
    assert statuses(run_all(over_base(base, unet=same))) == dict.fromkeys(STAGES, "hit")  # keyed by content
    mine = perturbed_copy(tmp_path / "model" / "unet", tmp_path / "my-unet")
    trained = {}
    for given in (mine, mine / "diffusion_pytorch_model.safetensors"):  # its folder, then its one file
        config = over_base(base, unet=given)
        rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
        assert rows["encode"]["status"] == "hit" and "models.unet" in rows["train"]["reason"]
        with count_encoder_rows() as counts:
            encoded = run_all(config, STAGES[:2])
        assert statuses(encoded) == {"preprocess": "hit", "encode": "hit"} and counts == {"vae": 0, "text": 0}
        results = run_all(config, placements=ahead)
        assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed", "evaluate": "computed"}
        trained[given] = load_file(Path(results["train"].path) / "pytorch_lora_weights.safetensors")
    lora, from_file = trained.values()  # the file converted to exactly the folder's weights trains the same LoRA
    assert lora.keys() == from_file.keys() and all(torch.equal(lora[k], from_file[k]) for k in lora)


@pytest.mark.parametrize("component, counted", [("vae", {"vae": 8, "text": 0}), ("text_encoder", {"vae": 0, "text": 9})])
def test_a_vae_or_text_encoder_over_the_base_re_encodes_its_records_only(baseline, tmp_path, count_encoder_rows,
                                                                         component, counted):
    from test_compose import perturbed_copy

    mine = perturbed_copy(baseline / "model" / component, tmp_path / f"my-{component}")
    for given in (mine, next(mine.glob("*.safetensors"))):  # its folder, then its one file (keyed by its own bytes)
        setting = {"vae": given} if component == "vae" else {"text_encoders": [given]}
        config = over_base(copy_of(baseline, tmp_path / given.name), **setting)
        row = next(r for r in explain(Context(config), STAGES) if r["stage"] == "encode")
        assert row["status"] == "miss" and f"models.{component}" in row["reason"]
        with count_encoder_rows() as counts:
            results = run_all(config, STAGES[:2])
        assert statuses(results) == {"preprocess": "hit", "encode": "computed"}
        assert counts == counted


def test_byte_identical_re_encode_does_not_rerun_train(baseline, tmp_path):
    config = copy_of(baseline, tmp_path)
    ctx = Context(config, log=lambda m: None)
    pre, pre_art = run_stage(ctx, "preprocess", {})
    first, _ = run_stage(ctx, "encode", {"preprocess": pre_art})
    forced, enc_art = run_stage(ctx, "encode", {"preprocess": pre_art}, force=True)
    trained, _ = run_stage(ctx, "train", {"preprocess": pre_art, "encode": enc_art})
    ctx.close()
    assert forced.status == "computed" and forced.digest == first.digest
    assert trained.status == "hit"


def test_a_truncated_file_in_a_published_artifact_is_a_logged_miss_then_rebuilt(baseline, tmp_path, ahead):
    shutil.copytree(baseline / "cache", tmp_path / "cache")  # damage a private copy of the cache
    config = make_config(tmp_path, baseline / "model", baseline / "data", tmp_path / "cache")
    lora = Path(run_all(config)["train"].path) / "pytorch_lora_weights.safetensors"
    lora.write_bytes(lora.read_bytes()[:100])
    logs: list[str] = []
    ctx = Context(config, log=logs.append, placements=ahead)
    upstream, results = {}, {}
    for stage in STAGES:
        results[stage], upstream[stage] = run_stage(ctx, stage, upstream)
    ctx.close()
    assert results["train"].status == "computed" and str(lora) in results["train"].reason
    assert any("miss" in line and str(lora) in line for line in logs)
    assert lora.stat().st_size > 100


def test_lowering_max_steps_trains_beside_the_longer_run_and_leaves_it_as_it_was(baseline, tmp_path, ahead):
    """max_steps 15 after the baseline's 20 (checkpoints 10 and 20, a constant lr): trained on from a
    copy of step 10 in a folder of its own; the 20-step training's files stay byte for byte. (Before
    the test that raises the baseline's max_steps.)"""
    from lorapipe.flows.steps import step_for

    config = private_copy(baseline, tmp_path, train={"max_steps": 15})
    ctx = Context(config, log=lambda m: None)
    work_key = step_for("train", ctx, {"encode": encoded_data(config)[1]}).key.work_key
    checkpoints = ctx.store.work_dir("train", work_key) / "checkpoints"
    ctx.close()
    before = {p: p.read_bytes() for p in sorted(checkpoints.parent.rglob("*")) if p.is_file()}
    results = run_all(config, STAGES[:3], placements=ahead)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed"}
    assert results["train"].info["resumed_from"] == 10 and results["train"].info["steps"] == 15
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000010", "step-000020"]
    assert {p: p.read_bytes() for p in sorted(checkpoints.parent.rglob("*")) if p.is_file()} == before


def test_raising_max_steps_continues_from_the_published_run(baseline, tmp_path, ahead):
    config = copy_of(baseline, tmp_path, train={"max_steps": 30})
    results = run_all(config, STAGES[:3], placements=ahead)
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed"}
    assert results["train"].reason == "changed: params.max_steps"
    assert results["train"].info["resumed_from"] == 20 and results["train"].info["steps"] == 30


def test_warm_start_continues_from_the_previous_lora_only_when_the_data_changed(baseline, tmp_path, ahead):
    from lorapipe.cache.digest import digest_file
    from lorapipe.flows.training import run_warm_train

    config = copy_of(baseline, tmp_path)
    ctx = Context(config, log=lambda m: None, placements=ahead)
    upstream = {}
    for stage in STAGES[:2]:
        _, upstream[stage] = run_stage(ctx, stage, upstream)
    same, previous = run_warm_train(ctx, upstream)
    assert same.status == "hit" and "unchanged data" in same.reason
    from PIL import Image, ImageOps

    ImageOps.mirror(Image.open(tmp_path / "data" / "rocket.jpg")).save(tmp_path / "data" / "rocket2.jpg")
    (tmp_path / "data" / "rocket2.txt").write_text("another rocket")
    upstream = {}
    for stage in STAGES[:2]:
        _, upstream[stage] = run_stage(ctx, stage, upstream)
    warm, artifact = run_warm_train(ctx, upstream)
    ctx.close()
    assert warm.status == "computed"
    lora = previous.path / "pytorch_lora_weights.safetensors"
    assert artifact.manifest["ingredients"]["inputs"]["init_lora"] == digest_file(lora)


def private_copy(baseline: Path, tmp_path: Path, **sections):
    """A config over copies of the baseline's model, data and cache (for tests that damage or force)."""
    shutil.copytree(baseline / "cache", tmp_path / "cache")
    return copy_of(baseline, tmp_path, tmp_path / "cache", **sections)


def encoded_data(config):
    from lorapipe.stages.encoded import EncodedData

    ctx = Context(config, log=lambda m: None)
    try:
        upstream = {}
        for stage in STAGES[:2]:
            _, upstream[stage] = run_stage(ctx, stage, upstream, run=False)
    finally:
        ctx.close()
    return EncodedData(upstream["encode"].path, config.cache_dir), upstream["encode"]


def test_a_shard_damaged_in_place_is_re_encoded_when_training_meets_it_and_training_resumes(
        baseline, tmp_path, count_encoder_rows, damage_in_place, capsys, ahead):
    """Training meets a record damaged in place: its shard is encoded again (its latents only),
    training resumes from its checkpoint, and the run's summary (run-summary.json, the table) says
    that encode, a hit, was repaired while train ran, with what was encoded."""
    from lorapipe.cache.samples import SampleStore

    from lorapipe.flows.commands import print_summary
    from lorapipe.flows.outputs import finish_run
    from lorapipe.flows.steps import step_for
    from lorapipe.stages.train.checkpoints import CheckpointDir

    config = private_copy(baseline, tmp_path, train={"max_steps": 50})  # resumes the baseline's training
    data, encoded = encoded_data(config)
    ctx = Context(config, log=lambda m: None)
    work = ctx.store.work_dir("train", step_for("train", ctx, {"encode": encoded}).key.work_key)
    ctx.close()
    latest = CheckpointDir(work / "checkpoints").steps()[-1]
    latent = data.split("train")[0].latent
    in_shard = len(data.store.shard_meta(latent.location.shard)["records"])
    shard = damage_in_place(data.store, latent)
    logs: list[str] = []
    ctx = Context(config, log=logs.append, placements=ahead)
    upstream, results = {}, {}
    with count_encoder_rows() as counts:
        for stage in STAGES[:3]:
            results[stage], upstream[stage] = run_stage(ctx, stage, upstream)
    results["evaluate"], _ = run_stage(ctx, "evaluate", upstream)  # renders: its text encoder runs
    ctx.close()
    assert any(f"{shard}: record {latent.key} does not match" in line for line in logs)
    assert counts == {"vae": in_shard, "text": 0}  # the damaged shard's latents, nothing else
    assert results["train"].status == "computed" and results["train"].info["resumed_from"] == latest
    assert results["train"].info["steps"] == 50 and results["evaluate"].status == "computed"
    repaired = ctx.store.lookup("encode", encoded.key).artifact  # rebuilt during train, with the same key
    assert repaired.digest == encoded.digest  # and the same data: training went on from its checkpoint
    assert ctx.store.verify(repaired) == [] and SampleStore(config.cache_dir).verify() == []
    summary = finish_run(tmp_path / "out", config, list(results.values()), "repairing", logs.append, record=False)
    assert summary == json.loads((tmp_path / "out" / "run-summary.json").read_text())["stages"]
    encode = summary[1]
    assert (encode["status"], encode["info"], len(encode["repairs"])) == ("repaired", {}, 1)  # a hit, then repaired
    repair = encode["repairs"][0]
    assert repair["during"] == "train" and repair["reason"].startswith(f"{shard}: record {latent.key} does not match")
    assert (repair["info"]["latents_encoded"], repair["info"]["texts_encoded"]) == (in_shard, 0)
    capsys.readouterr()
    print_summary(config, summary, tmp_path / "run.log", as_json=False)
    table = capsys.readouterr().out
    assert "repaired while train ran" in table and f"latents encoded {in_shard}, reused " in table
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("encode")] == [["encode", "repaired"]]


def test_a_repaired_or_compacted_shard_reruns_only_encode(baseline, tmp_path, count_encoder_rows):
    from lorapipe.cache.samples import SampleStore

    config = private_copy(baseline, tmp_path)
    data, _ = encoded_data(config)
    store = SampleStore(config.cache_dir)
    latent_shards = sorted({s.latent.location.shard for s in data.samples})
    store.remove(latent_shards[0])  # what `cache verify` does with a damaged shard
    with count_encoder_rows() as counts:
        repaired = run_all(config)
    assert statuses(repaired) == {"preprocess": "hit", "encode": "computed", "train": "hit", "evaluate": "hit"}
    assert counts["text"] == 0 and 0 < counts["vae"] < 8
    moved = {key: {ext: store.read(key, where, ext) for ext in where.members}  # compact two shards into one
             for key, where in store.index().items() if where.shard in latent_shards[1:3]}
    store.write_shard(moved)
    for shard in latent_shards[1:3]:
        store.remove(shard)
    with count_encoder_rows() as counts:
        compacted = run_all(config)
    assert statuses(compacted) == {"preprocess": "hit", "encode": "computed", "train": "hit", "evaluate": "hit"}
    assert counts == {"vae": 0, "text": 0}


def test_renamed_and_moved_images_rerun_preprocess_and_encode_but_not_training(baseline, tmp_path, count_encoder_rows,
                                                                              ahead):
    config = private_copy(baseline, tmp_path)
    data = tmp_path / "data"
    (data / "moved").mkdir()
    for image in sorted(data.glob("*.jpg")):  # every file gets another name, one another folder too
        where = data / "moved" if image.stem == "coffee" else data
        image.rename(where / f"renamed-{image.name}")
        image.with_suffix(".txt").rename(where / f"renamed-{image.stem}.txt")
    with count_encoder_rows() as counts:
        results = run_all(config)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed", "train": "hit", "evaluate": "hit"}
    assert counts == {"vae": 0, "text": 0}
    # and training on the renamed files trains the same LoRA:
    ctx = Context(config, log=lambda m: None, placements=ahead)
    upstream = {stage: ctx.store.lookup(stage, results[stage].key).artifact for stage in STAGES[:2]}
    for stage in ("train", "evaluate"):  # the batch plan, split and evaluate's noise follow content
        forced, upstream[stage] = run_stage(ctx, stage, upstream, force=True)
        assert forced.status == "computed" and forced.digest == results[stage].digest, stage
    ctx.close()


def test_a_prior_dataset_its_weight_and_target_rerun_training_but_encode_nothing(baseline, tmp_path, count_encoder_rows,
                                                                                ahead):
    """Four photos made a prior dataset: preprocess reruns (its manifest: no pixels), encode writes a
    new index and encodes nothing, train and evaluate rerun (evaluate scores the subject's samples
    only); then train.prior_loss_weight and train.prior_target rerun train alone."""
    copy_of(baseline, tmp_path)
    data = tmp_path / "data"
    for folder in ("subject", "prior"):
        (data / folder).mkdir()
    for image in sorted(data.glob("*.jpg")):
        folder = data / ("prior" if image.stem in ("hubble_deep_field", "immunohistochemistry", "retina", "rocket")
                         else "subject")
        for file in (image, image.with_suffix(".txt")):
            file.rename(folder / file.name)

    def config(role: str, **train):
        section = {"datasets": [{"path": data / "subject"}, {"path": data / "prior", "role": role}]}
        return make_config(tmp_path, tmp_path / "model", section, baseline / "cache",
                           train={"max_steps": 4, "checkpoint_every": 2, **train})

    with count_encoder_rows() as counts:
        assert statuses(run_all(config("train"), STAGES[:2])) == {"preprocess": "computed", "encode": "computed"}
        rows = {r["stage"]: r for r in explain(Context(config("prior")), STAGES)}
        assert rows["preprocess"]["status"] == "miss" and "role" in rows["preprocess"]["reason"]
        trained = run_all(config("prior"), STAGES[:3], placements=ahead)
    assert counts == {"vae": 0, "text": 0}  # (evaluate's renders encode their prompts: not counted)
    assert statuses(trained) == dict.fromkeys(STAGES[:3], "computed")
    prior = run_all(config("prior"))
    assert statuses(prior) == {"preprocess": "hit", "encode": "hit", "train": "hit", "evaluate": "computed"}
    metrics = json.loads((Path(prior["evaluate"].path) / "metrics.json").read_text())
    assert metrics["n_samples_in_split"] == {"holdout": 1, "train": 3}  # the subject's four, one held out
    for setting in ("prior_loss_weight", "prior_target"):
        results = run_all(config("prior", **{setting: {"prior_loss_weight": 0.5, "prior_target": "base_output"}[setting]}),
                          STAGES[:3], placements=ahead)
        assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed"}
        assert f"params.{setting}" in results["train"].reason
