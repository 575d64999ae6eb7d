"""A Hugging Face repo id as model.path, resolved offline from a local Hugging Face cache laid out
as huggingface_hub writes it (tests/hub_cache.py): it runs as the same model given as a folder
does, with the same keys, and the run records the repo and the one commit it used throughout; `lorapipe model` shows
what a model is made of without loading it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import huggingface_hub
import pytest
import yaml
from conftest import LOADED_AT_EXIT, REPO
from hub_cache import write_hub_cache

from lorapipe.cache.errors import UserError
from lorapipe.flows.config import ConfigError, load_config
from lorapipe.flows.steps import Context, pinned

REPO_ID = "owner/tiny-sd"


def hub_config(config_path, name: str, **model) -> object:
    """A copy of the config at `config_path` (beside it, as `name`) whose model is `model`."""
    raw = yaml.safe_load(config_path.read_text())
    copy = config_path.with_name(name)
    copy.write_text(yaml.safe_dump({**raw, "model": model}))
    return copy


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache for this test: the folder huggingface_hub reads (HF_HUB_OFFLINE
    is set for the whole suite: tests/conftest.py)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_repo_id_trains_with_the_keys_of_its_folder_and_the_run_records_its_commit(
        tmp_path, tiny_config, tiny_model, run_stages, hf_cache, monkeypatch, capsys):
    from lorapipe.flows.cached_run import all_cached_run
    from lorapipe.flows.commands import print_summary
    from lorapipe.flows.run_plan import plan_run, plan_status

    folder_config = tiny_config(tmp_path, "hub", max_steps=2, checkpoint_every=2)
    commit = write_hub_cache(hf_cache, REPO_ID, tiny_model)
    config_path = hub_config(folder_config, "hub.yaml", path=REPO_ID)
    done = run_stages(config_path, ("preprocess", "encode", "train"))  # trains on the snapshot's files
    assert [result.status for result, _ in done.values()] == ["computed"] * 3
    folder = plan_status(load_config(folder_config), print)
    assert [s.row()["status"] for s in folder.standings][:3] == ["hit"] * 3  # the same keys as the folder's

    moved = tmp_path / "moved-hf-cache"  # the snapshot's links are relative: a moved cache is the same model
    shutil.move(hf_cache, moved)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(moved))
    config = pinned(load_config(config_path))  # as `lorapipe run` does first
    plan = plan_run(config, ["train"], None, [], print)
    write_hub_cache(moved, REPO_ID, tiny_model, commit="2" * 40)  # main moves between the plan and the run
    summary = all_cached_run(config, plan)
    assert [row["status"] for row in summary] == ["hit"] * 3
    recorded = json.loads((config.output_dir / "run-summary.json").read_text())["model"]
    assert recorded == {"kind": "hub", "location": REPO_ID, "revision": "main", "commit": commit}  # one commit
    print_summary(config, summary, tmp_path / "run.log", as_json=False)
    assert f"model:       hub {REPO_ID}@{commit}\n" in capsys.readouterr().out


def test_a_sweeps_variants_train_on_the_commit_its_branch_named_at_the_start(tmp_path, tiny_config, tiny_model,
                                                                            hf_cache):
    from lorapipe.flows.sweep.grid import load_sweep, pinned_sweep

    commit = write_hub_cache(hf_cache, REPO_ID, tiny_model)
    config_path = hub_config(tiny_config(tmp_path, "sweep"), "hub.yaml", path=REPO_ID)
    sweep = pinned_sweep(load_sweep(config_path, grid=["train.learning_rate=1e-4,2e-4"]))
    write_hub_cache(hf_cache, REPO_ID, tiny_model, commit="2" * 40)  # main moves while the sweep runs
    for config in (sweep.base, *(v.config for v in sweep.variants)):
        ctx = Context(config, log=lambda line: None)
        try:
            assert ctx.base.source.commit == commit and config.model.configured_revision == "main"
        finally:
            ctx.close()


def test_only_what_a_diffusers_pipeline_loads_is_fetched():
    """A repo's files as the Hub lists them (FLUX.1-dev's, in part, and a chat template as transformers
    writes it, which Flux.2's and Z-Image's text records read): the pipeline's folders, never its
    top-level single-file checkpoints nor pickled weights."""
    from huggingface_hub.utils import filter_repo_objects

    from lorapipe.stages.sources.hub import PIPELINE_FILES

    fetched = ["model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
               "text_encoder/model.safetensors", "text_encoder_2/model-00001-of-00002.safetensors",
               "text_encoder_2/model.safetensors.index.json", "tokenizer/chat_template.jinja", "tokenizer/merges.txt", "tokenizer/vocab.json",
               "tokenizer_2/spiece.model", "tokenizer_2/tokenizer.json", "transformer/config.json",
               "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
               "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
               "vae/diffusion_pytorch_model.safetensors"]
    left = ["flux1-dev.safetensors", "ae.safetensors", "README.md", "dev_grid.jpg", "LICENSE.md", ".gitattributes",
            "text_encoder/pytorch_model.bin", "vae/diffusion_pytorch_model.bin", "unet/model.ckpt", "unet/model.pt"]
    assert list(filter_repo_objects(fetched + left, allow_patterns=PIPELINE_FILES)) == fetched


def test_a_modular_repos_index_is_fetched():
    """A model diffusers ships only as a modular pipeline (FLUX.3) is indexed by modular_model_index.json."""
    from huggingface_hub.utils import filter_repo_objects

    from lorapipe.stages.sources.hub import PIPELINE_FILES

    files = ["modular_model_index.json", "transformer/config.json", "README.md"]
    assert list(filter_repo_objects(files, allow_patterns=PIPELINE_FILES)) == files[:2]


def test_a_revision_is_a_commit_a_tag_or_a_branch(tmp_path, tiny_config, tiny_model, hf_cache):
    first = write_hub_cache(hf_cache, REPO_ID, tiny_model, refs=("main", "v1.0"))
    second = write_hub_cache(hf_cache, REPO_ID, tiny_model, refs=("dev",), commit="1" * 40)
    folder_config = tiny_config(tmp_path, "revisions")

    def resolved(**model) -> str:
        ctx = Context(load_config(hub_config(folder_config, "hub.yaml", **model)), log=lambda line: None)
        try:
            assert (ctx.base.path / "model_index.json").is_file()
            return ctx.base.source.commit
        finally:
            ctx.close()

    assert resolved(path=REPO_ID) == first
    assert resolved(path=REPO_ID, revision="v1.0") == first
    assert resolved(path=REPO_ID, revision="dev") == second
    assert resolved(path=REPO_ID, revision=second) == second


def test_an_uncached_repo_a_bad_revision_and_a_revision_of_a_folder_are_one_line_each(
        tmp_path, tiny_config, tiny_model, hf_cache):
    write_hub_cache(hf_cache, REPO_ID, tiny_model)
    folder_config = tiny_config(tmp_path, "refused")

    def error(**model) -> str:
        with pytest.raises(UserError) as raised:
            Context(load_config(hub_config(folder_config, "hub.yaml", **model))).base  # noqa: B018
        assert "\n" not in str(raised.value)
        return str(raised.value)

    assert error(path="owner/elsewhere") == (
        f"model.path: Hugging Face repo owner/elsewhere@main is not in the Hugging Face cache ({hf_cache}) and"
        " HF_HUB_OFFLINE is set; nor is owner/elsewhere a local path")
    assert error(path=REPO_ID, revision="v9").startswith(f"model.path: Hugging Face repo {REPO_ID}@v9 is not in")
    with pytest.raises(ConfigError, match="model.revision: .*model.path .* is a local path: a revision is"):
        load_config(hub_config(folder_config, "local.yaml", path=str(tiny_model), revision="main"))


def lorapipe_model(config_path, *env: tuple[str, str]) -> tuple[dict, str]:
    """`lorapipe model CONFIG --json`'s document, and which model libraries its process loaded."""
    import os

    run = subprocess.run([sys.executable, "-c", LOADED_AT_EXIT, "model", str(config_path), "--json"], cwd=REPO,
                         env={**os.environ, **dict(env)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout), run.stderr.splitlines()[-1]


def test_the_model_command_lists_each_component_without_loading_it(tmp_path, tiny_config, tiny_model, hf_cache):
    from lorapipe.cache.digest import StatCache
    from lorapipe.stages import families
    from lorapipe.stages.models import component_digests

    folder_config = tiny_config(tmp_path, "model")
    report, loaded = lorapipe_model(folder_config)
    assert loaded == "loaded: []"  # no torch, diffusers nor transformers for a folder model
    assert (report["family"], report["variant"]) == ("sd15", "sd15")
    assert report["source"] == {"kind": "folder", "location": str(tiny_model)}
    rows = {row["name"]: row for row in report["components"]}
    with StatCache(tmp_path / "stat.sqlite") as stat_cache:
        digests = component_digests(tiny_model, stat_cache, families.for_model(tiny_model))
    assert {name: row["digest"] for name, row in rows.items()} == digests  # the stage keys' digests
    assert rows["unet"]["class_name"] == "diffusers.UNet2DConditionModel" and rows["unet"]["dtype"] == "F32"
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    assert rows["unet"]["parameters"] == sum(p.numel() for p in unet.parameters())
    assert (rows["scheduler"]["dtype"], rows["scheduler"]["parameters"]) == (None, 0)

    commit = write_hub_cache(hf_cache, REPO_ID, tiny_model)
    hub, _ = lorapipe_model(hub_config(folder_config, "hub.yaml", path=REPO_ID), ("HF_HUB_CACHE", str(hf_cache)))
    assert hub["source"] == {"kind": "hub", "location": REPO_ID, "revision": "main", "commit": commit}
    assert [{**row, "source": None} for row in hub["components"]] == \
        [{**row, "source": None} for row in report["components"]]
