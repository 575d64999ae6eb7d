"""Components over a base (model.unet, model.vae, model.text_encoders, ...): the diffusers folder
composed in the cache, what keys each component, and the one-line refusals. The counts of what a
component over the base reruns are in tests/test_invalidation.py (its trained baseline)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lorapipe.cache.errors import UserError
from lorapipe.flows.config import load_config, validate_config
from lorapipe.flows.steps import Context


def perturbed_copy(folder: Path, to: Path) -> Path:
    """A copy of a component folder with one tensor changed (a "different" component)."""
    shutil.copytree(folder, to)
    weights = next(to.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k, v in sorted(tensors.items()) if v.is_floating_point())
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, weights, metadata={"format": "pt"})
    return to


def context(tmp_path: Path, base: Path, **model) -> Context:
    raw = {"cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out"),
           "model": {"path": str(base), **model}, "data": {"path": str(tmp_path)}, "train": {},
           "evaluate": {"prompts": ["a photo"]}}
    return Context(validate_config(raw, "test"))


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_a_vae_folder_over_a_base_composes_links_keys_itself_and_loads_in_the_pipeline(tmp_path, tiny_model, capsys):
    from diffusers import StableDiffusionPipeline

    vae = perturbed_copy(tiny_model / "vae", tmp_path / "my-vae")
    before = snapshot(tiny_model), snapshot(vae)
    ctx = context(tmp_path, tiny_model, vae=str(vae))
    folder = ctx.model_path
    assert folder.parent == tmp_path / "cache" / "models"
    assert (folder / "model_index.json").read_bytes() == (tiny_model / "model_index.json").read_bytes()
    links = {p.name: p.readlink() for p in folder.iterdir() if p.is_symlink()}
    assert links == {**{name: tiny_model / name for name in ("scheduler", "text_encoder", "tokenizer", "unet")},
                     "vae": vae}  # links, no copies
    assert {k for k, v in ctx.model_digests.items() if v != ctx.base_digests[k]} == {"vae"}
    assert ctx.identity == ctx.base_digests["unet"] and ctx.family.name == "sd15"
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    ours = load_file(vae / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(pipe.vae.state_dict()[k], v) for k, v in ours.items())
    again = context(tmp_path, tiny_model, vae=str(vae))
    assert again.model_path == folder and sorted(folder.parent.iterdir()) == [folder]  # made once, no staging left
    assert (snapshot(tiny_model), snapshot(vae)) == before  # the user's files are left as they were
    rows = lorapipe_model(again.config, tmp_path / "run.yaml", capsys)
    assert rows["vae"]["source"] == {"kind": "folder", "location": str(vae)}
    assert rows["vae"]["digest"] == ctx.model_digests["vae"] and rows["vae"]["class_name"] == "diffusers.AutoencoderKL"
    assert rows["unet"]["source"] == {"kind": "folder", "location": str(tiny_model)}


def lorapipe_model(config, path: Path, capsys) -> dict[str, dict]:
    """`lorapipe model CONFIG --json`'s rows by component."""
    from lorapipe.flows.commands import model

    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    capsys.readouterr()
    assert model(path, [], as_json=True) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)["components"]}


def test_text_encoders_by_name_or_in_order_and_components_the_model_has_not_are_refused(tmp_path, tiny_model):
    encoder = tiny_model / "text_encoder"
    by_name = context(tmp_path, tiny_model, text_encoders={"text_encoder": str(encoder)}).components
    assert by_name == context(tmp_path, tiny_model, text_encoders=[str(encoder)]).components == {"text_encoder": encoder}
    refusals = [
        ({"transformer": str(encoder)}, "model.transformer: a Stable Diffusion 1.x/2.x model has no transformer; what"
         " can be set over its base: model.unet, model.vae, model.text_encoders (text_encoder)"),
        ({"transformer_2": str(encoder)}, "model.transformer_2: a Stable Diffusion 1.x/2.x model has no transformer_2"),
        ({"text_encoders": [str(encoder)] * 2}, "model.text_encoders: 2 given but the model has 1 text encoders:"
         " text_encoder (a list is taken in that order)"),
        ({"text_encoders": {"text_encoder_2": str(encoder)}}, "model.text_encoders: the model has no text encoder"
         " 'text_encoder_2'; its text encoders: text_encoder"),
        ({"vae": str(tmp_path / "missing")}, f"model.vae: {tmp_path / 'missing'} is neither a .safetensors file nor a"
         " diffusers component folder"),
    ]
    for model, line in refusals:
        with pytest.raises(UserError) as refused:
            context(tmp_path, tiny_model, **model).model_digests  # noqa: B018  (run_plan reads it first)
        assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_component_paths_resolve_against_the_config_file_like_model_path(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    raw = {"cache_dir": "cache", "output_dir": "out", "data": {"path": "data"}, "train": {},
           "evaluate": {"prompts": ["a photo"]},
           "model": {"path": "base", "unet": "../unet", "vae": "vae.safetensors", "text_encoders": ["te"]}}
    (folder / "run.yaml").write_text(yaml.safe_dump(raw))
    model = load_config(folder / "run.yaml").model
    assert model.components == {"unet": tmp_path / "unet", "vae": folder / "vae.safetensors"}
    assert model.text_encoders == (folder / "te",)
