"""train.adapter: LoRA, DoRA, LoKr and LoHa through peft's configs, and the files each exports, on
the tiny SD1.x and Flux.1 models. A file is checked by what it does to the weights: loaded (through
diffusers where it can load the format, else by the format's documented rules, recomputed here from
the file's tensors) it must give every weight the in-memory peft model's merged value."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import merged, respelled_as_kohya, weight
from safetensors import safe_open
from safetensors.torch import load_file

import lorapipe.stages.families as families
from lorapipe.stages.families.folders import empty_component
from lorapipe.stages.lora_formats.diffusers_format import ADAPTER, peft_state_dict, write_diffusers_lora
from lorapipe.stages.lora_formats.lycoris import adapted_modules
from lorapipe.stages.train.adapter import AdapterParams, peft_config, plain_lora_alpha, plain_lora_swapped_in

ADAPTER_KEYS = ("lora_", "lokr_", "hada_")  # peft's adapter parameters carry one of these


@pytest.fixture(scope="module")
def flux_dev(tiny_models) -> Path:
    return tiny_models("flux1")


def trained_adapter(family, model: Path, params: AdapterParams, targets: str | tuple[str, ...]):
    """The tiny denoiser with `params`' adapter, every adapter weight moved off its initial value (as
    after training: no factor zero, DoRA's magnitude no longer the row norms)."""
    denoiser = family.load_denoiser(model, torch.float32)
    targets = family.lora_target_modules(denoiser, targets)
    torch.manual_seed(0)
    denoiser.add_adapter(peft_config(params, targets))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if any(k in name for k in ADAPTER_KEYS):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return denoiser


def exported_comfyui_file(family, denoiser, out_dir: Path) -> Path:
    """The family's export of a DoRA/LoKr/LoHa: the diffusers file, then ComfyUI's."""
    written = family.export_lora(denoiser, out_dir, {"lorapipe.steps": "1"}, {})
    assert [p.name for p in written] == ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors"]
    with safe_open(written[1], "pt") as f:
        assert f.metadata()["ss_base_model_version"] == family.kohya.base_model
    return written[1]


def per_module(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """original module -> its tensors, by the key after the module name."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        original, suffix = _split(key)
        out.setdefault(original, {})[suffix] = value
    return out


def _split(key: str) -> tuple[str, str]:
    name = key.removeprefix("diffusion_model.")
    for suffix in ("lora_A.weight", "lora_B.weight"):
        if name.endswith("." + suffix):
            return name.removesuffix("." + suffix), suffix
    original, suffix = name.rsplit(".", 1)
    return original, suffix


def documented_keys(kind: str, t: dict[str, torch.Tensor]) -> set[str]:
    """The LyCORIS key set ComfyUI reads for a module (comfy/weight_adapter/{lora,lokr,loha}.py), with
    no `.alpha`: the scale is folded into the first factor, and ComfyUI applies a file without alpha
    at scale 1."""
    if kind == "dora":
        return {"lora_A.weight", "lora_B.weight", "dora_scale"}
    if kind == "loha":
        return {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}
    return {f"lokr_{w}" if f"lokr_{w}" in t else f"lokr_{w}_{ab}" for w in ("w1", "w2") for ab in "ab"}


# ---- the spec and peft's configs

@pytest.mark.parametrize("settings, key", [
    ({"adapter": "lokr", "rslora": True}, "train.rslora applies to adapter lora and dora, not lokr"),
    ({"adapter": "loha", "dropout": 0.1}, "train.dropout applies to adapter lora and dora, not loha"),
    ({"adapter": "dora", "init": "pissa"}, "train.init applies to adapter lora, not dora"),
    ({"adapter": "lora", "lokr_factor": 4}, "train.lokr_factor applies to adapter lokr, not lora"),
    ({"adapter": "lokr", "lokr_factor": 0}, "train.lokr_factor: a positive factor, or -1"),
])
def test_settings_that_do_not_apply_are_refused_by_name(settings, key):
    with pytest.raises(ValueError, match=key):
        AdapterParams(**settings)


@pytest.mark.parametrize("arch, kind, target, module, hint", [
    ("sd15", "lora", "to_out", r"down_blocks\.1\.attentions\.0\.transformer_blocks\.0\.attn1\.to_out", "to_out.0"),
    ("flux2-klein", "lokr", "attn.to_out", r"transformer_blocks\.0\.attn\.to_out", "attn.to_out.0"),
])
def test_a_target_that_is_not_a_layer_is_refused_by_name_without_the_weights(arch, kind, target, module, hint,
                                                                             tiny_model, flux2_model, tmp_path):
    """A target_modules name that matches a container (diffusers' attention to_out is a ModuleList)
    ended training with peft's raw TypeError; it is refused in one line from the model's structure,
    which needs no weights (the denoiser's weights file is gone here)."""
    from lorapipe.cache.errors import UserError
    from lorapipe.stages.train.adapter import check_targets

    model = tmp_path / "model"
    shutil.copytree({"sd15": tiny_model, "flux2-klein": flux2_model}[arch], model)
    family = families.for_model(model)
    for weights in (model / family.components.denoiser).glob("*.safetensors"):
        weights.unlink()
    structure = empty_component(model, family.components.denoiser)
    targets = family.lora_target_modules(structure, (target, "to_q"))
    with pytest.raises(UserError, match=rf"^train\.target_modules: {re.escape(target)}: {module} is a ModuleList,"
                                        rf" which a {kind} cannot adapt \(only [\w, ]*Linear[\w, ]*\): name a"
                                        rf" layer inside it, such as {re.escape(hint)}$"):
        check_targets(structure, kind, targets)
    check_targets(structure, kind, family.lora_target_modules(structure, (hint, "to_q")))


@pytest.mark.parametrize("settings", [
    {"adapter": "lora"}, {"adapter": "lora", "rslora": True, "rank": 8, "alpha": 4}, {"adapter": "dora"},
    {"adapter": "lokr", "rank": 2, "alpha": 3}, {"adapter": "lokr", "lokr_factor": 4},
    {"adapter": "loha", "rank": 2, "alpha": 3},
])
def test_peft_builds_the_adapter_at_the_params_scale(settings, tiny_model):
    params = AdapterParams(**settings)
    family = families.for_model(tiny_model)
    denoiser = family.load_denoiser(tiny_model, torch.float32)
    targets = family.lora_target_modules(denoiser, "attention")
    expected = sorted(n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
                      and n.endswith(tuple(f".{t}" for t in targets)))
    denoiser.add_adapter(peft_config(params, targets))
    layers = adapted_modules(denoiser)
    assert layers == expected and len(layers) == 32  # q/k/v/out of attn1 and attn2 in 4 transformer blocks
    assert [denoiser.get_submodule(m).scaling[ADAPTER] for m in layers] == pytest.approx([params.scale] * 32)
    kind = {"lora": "LoraLayer", "dora": "LoraLayer", "lokr": "LoKrLayer", "loha": "LoHaLayer"}[params.adapter]
    assert all(kind in [c.__name__ for c in type(denoiser.get_submodule(m)).__mro__] for m in layers)
    assert denoiser.peft_config[ADAPTER].to_dict().get("use_dora", False) == (params.adapter == "dora")
    if params.lokr_factor != -1:  # the Kronecker factor's side is the factor (w1 is factor x factor)
        assert {tuple(v.shape) for k, v in peft_state_dict(denoiser).items() if k.endswith("lokr_w1")} == {(4, 4)}


# ---- the diffusers/peft file

def _model(arch: str, tiny_model: Path, flux_dev: Path) -> Path:
    return tiny_model if arch == "sd15" else flux_dev


def _pipeline(model: Path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(model)


@pytest.mark.parametrize("kind, arch", [("lora", "sd15"), ("dora", "sd15"), ("dora", "flux1")])
def test_diffusers_file_loads_in_diffusers_and_means_the_merged_model(kind, arch, tiny_model, flux_dev, tmp_path):
    """DoRA's magnitude travels in the diffusers file (`lora_magnitude_vector`, use_dora in the
    adapter metadata) and diffusers applies it: fuse_lora gives peft's merged weights."""
    model = _model(arch, tiny_model, flux_dev)
    family = families.for_model(model)
    denoiser = trained_adapter(family, model, AdapterParams(adapter=kind, alpha=3), "attention")
    file = family.export_lora(denoiser, tmp_path, {}, {})[0]
    pipe = _pipeline(model)
    pipe.load_lora_weights(tmp_path, weight_name=file.name)
    pipe.fuse_lora()
    loaded, after = getattr(pipe, family.components.denoiser), merged(denoiser)
    for name in adapted_modules(denoiser):
        assert torch.allclose(loaded.get_submodule(name).weight, weight(after, name), atol=1e-6), name


@pytest.mark.parametrize("kind, arch", [("lokr", "sd15"), ("loha", "sd15"), ("lokr", "flux1"), ("loha", "flux1")])
def test_lycoris_types_load_through_peft_not_diffusers(kind, arch, tiny_model, flux_dev, tmp_path):
    """diffusers' load_lora_weights reads LoRA (and DoRA) only: it refuses a LoKr/LoHa file. The file
    is peft's state dict with peft's config in its metadata, which peft loads into a fresh denoiser."""
    from peft import set_peft_model_state_dict
    from peft.config import PeftConfig

    model = _model(arch, tiny_model, flux_dev)
    family = families.for_model(model)
    prefix = f"{family.components.denoiser}."
    denoiser = trained_adapter(family, model, AdapterParams(adapter=kind, rank=2, alpha=3), "attention")
    file = family.export_lora(denoiser, tmp_path, {}, {})[0]
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        _pipeline(model).load_lora_weights(tmp_path, weight_name=file.name)
    with safe_open(file, "pt") as f:
        recorded = json.loads(f.metadata()["lora_adapter_metadata"])
    config = PeftConfig.from_peft_type(**{k.removeprefix(prefix): v for k, v in recorded.items()})
    fresh = family.load_denoiser(model, torch.float32)
    fresh.add_adapter(config)
    result = set_peft_model_state_dict(fresh, {k.removeprefix(prefix): v for k, v in load_file(file).items()})
    assert not result.unexpected_keys
    loaded, after = merged(fresh), merged(denoiser)
    for name in adapted_modules(denoiser):
        assert torch.allclose(weight(loaded, name), weight(after, name), atol=1e-6), name


@pytest.mark.parametrize("kind", ["lora", "dora", "lokr", "loha"])
def test_checkpoint_file_restores_every_adapter_type_exactly(kind, tiny_model, tmp_path):
    """What training's checkpoint hooks do (write_diffusers_lora, then load_diffusers_lora into a fresh
    denoiser given the same adapter): every adapter tensor comes back bit for bit."""
    from lorapipe.stages.lora_formats.diffusers_format import load_diffusers_lora

    family = families.for_model(tiny_model)
    params = AdapterParams(adapter=kind, rank=2, alpha=3)
    unet = trained_adapter(family, tiny_model, params, "attention")
    write_diffusers_lora(unet, tmp_path / "checkpoint.safetensors", {}, "unet")
    fresh = family.load_denoiser(tiny_model, torch.float32)
    fresh.add_adapter(peft_config(params, family.lora_target_modules(fresh, "attention")))
    load_diffusers_lora(fresh, tmp_path / "checkpoint.safetensors", "unet")
    saved, restored = peft_state_dict(unet), peft_state_dict(fresh)
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


# ---- the ComfyUI (LyCORIS) file

@pytest.mark.parametrize("kind, arch, rank", [("dora", "sd15", 2), ("lokr", "sd15", 2), ("lokr", "sd15", 8),
                                             ("loha", "sd15", 2), ("lokr", "sdxl", 2)])
def test_sd_comfyui_file_has_the_lycoris_keys_and_means_the_merged_model(kind, arch, rank, tiny_model, sdxl_model,
                                                                          tmp_path):
    """Every Linear of the UNet (SDXL: with its size embedding, label_emb) under its LDM name. A LoKr
    of rank 8 keeps its factors whole (no `_a/_b`). ComfyUI reads every key and applies the trained model."""
    model = tiny_model if arch == "sd15" else sdxl_model
    family = families.for_model(model)
    unet = trained_adapter(family, model, AdapterParams(adapter=kind, rank=rank, alpha=3), "all_linear")
    names = family.original_names(unet)
    file = exported_comfyui_file(family, unet, tmp_path)
    modules = per_module(load_file(file))
    assert "middle_block.1.transformer_blocks.0.attn2.to_k" in modules and len(modules) == len(names)
    assert ("label_emb.0.0" in modules) == (arch == "sdxl")
    if kind == "lokr":
        assert any("lokr_w2" in t for t in modules.values()) == (rank == 8)  # some factors whole
    for original, t in modules.items():
        assert set(t) == documented_keys(kind, t), original
    assert_comfyui_applies_the_merged_model(file, unet, family)


def test_sd_dora_comfyui_file_through_diffusers_drops_the_magnitude(tiny_model, tmp_path):
    """diffusers' kohya/SGM converter reads the DoRA file's LoRA part and drops `dora_scale` (with a
    warning): it cannot load a DoRA in this format, which is why the test above recomputes it."""
    from diffusers import DiffusionPipeline

    family = families.for_model(tiny_model)
    unet = trained_adapter(family, tiny_model, AdapterParams(adapter="dora", rank=2, alpha=3), "attention")
    file = exported_comfyui_file(family, unet, tmp_path)
    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    converted, _ = pipe.lora_state_dict(respelled_as_kohya(file, tmp_path / "kohya.safetensors"),
                                        unet_config=pipe.unet.config)
    assert converted and not any("dora" in k or "magnitude" in k for k in converted)


@pytest.mark.parametrize("kind", ["dora", "loha"])
def test_flux_comfyui_file_fuses_qkv_and_means_the_merged_model(kind, flux_dev, tmp_path):
    """Attention: double blocks' q/k/v fuse into img_attn.qkv, single blocks' into linear1 next to
    the MLP input, which has no adapter (its DoRA magnitude rows are its own row norms)."""
    family = families.for_model(flux_dev)
    transformer = trained_adapter(family, flux_dev, AdapterParams(adapter=kind, rank=2, alpha=3), "attention")
    file = exported_comfyui_file(family, transformer, tmp_path)
    tensors = load_file(file)
    fused_rank = {"dora": "lora_A.weight", "loha": "hada_w1_b"}[kind]
    assert tensors[f"diffusion_model.double_blocks.0.img_attn.qkv.{fused_rank}"].shape[0] == 3 * 2
    assert f"diffusion_model.single_blocks.0.linear1.{fused_rank}" in tensors
    assert not any(k.endswith(".alpha") for k in tensors)
    assert_comfyui_applies_the_merged_model(file, transformer, family)


def test_flux_lokr_on_fused_modules_is_written_under_comfyuis_slice_names(flux_dev, tmp_path):
    """A Kronecker product cannot be split by rows: q/k/v (fused in qkv and linear1) keep their
    diffusers names under `transformer.`, which ComfyUI's Flux key map points at their rows of the
    fused weight; whole modules keep their BFL names. Without such a map the export refuses by name."""
    from lorapipe.stages.lora_formats.lycoris import lycoris_state_dict

    family = families.for_model(flux_dev)
    transformer = trained_adapter(family, flux_dev, AdapterParams(adapter="lokr", rank=2, alpha=3), "attention")
    names = family.original_names(transformer)
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn\.\w+: a LoKr cannot be written on"
                                         r" double_blocks\.0\.\w+_attn\.qkv"):
        lycoris_state_dict(transformer, names)
    file = exported_comfyui_file(family, transformer, tmp_path)
    targets = set(per_module(load_file(file)))
    assert {"transformer.transformer_blocks.0.attn.to_q", "transformer.single_transformer_blocks.0.attn.to_v",
            "double_blocks.0.img_attn.proj", "double_blocks.0.txt_attn.proj"} <= targets
    assert not any(t.startswith(("double_blocks.0.img_attn.qkv", "single_blocks.0.linear1")) for t in targets)
    assert_comfyui_applies_the_merged_model(file, transformer, family)


# ---- PiSSA / OLoRA

@pytest.mark.parametrize("init, rslora", [("pissa", False), ("olora", False), ("pissa", True)])
def test_svd_initialised_lora_exports_as_a_plain_lora_on_the_original_base(init, rslora, tiny_model, tmp_path):
    """PiSSA/OLoRA subtract the adapter's start from the base weights; the family's export, shown the
    plain-LoRA form, writes a rank-2r LoRA for the original base, and diffusers' fuse_lora of it on
    the original model gives the trained model's weights; the trained adapter is back afterwards."""
    from diffusers import StableDiffusionPipeline

    family = families.for_model(tiny_model)
    params = AdapterParams(init=init, rslora=rslora, rank=2, alpha=3)
    original = family.load_denoiser(tiny_model, torch.float32)
    unet = family.load_denoiser(tiny_model, torch.float32)
    unet.add_adapter(peft_config(params, family.lora_target_modules(unet, "attention")))
    initial = {k: v.clone() for k, v in peft_state_dict(unet).items()}
    with torch.no_grad():  # training moves the adapter only
        for name, param in unet.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.05)
    trained = {k: v.clone() for k, v in peft_state_dict(unet).items()}
    with plain_lora_swapped_in(unet, initial, params):
        written = family.export_lora(unet, tmp_path, {}, {})
    assert peft_state_dict(unet).keys() == trained.keys()
    assert all(torch.equal(peft_state_dict(unet)[k], v) for k, v in trained.items())
    with safe_open(written[0], "pt") as f:
        recorded = json.loads(f.metadata()["lora_adapter_metadata"])
        down = f.get_tensor("unet.mid_block.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight")
    assert (recorded["unet.r"], recorded["unet.lora_alpha"], down.shape[0]) == (4, plain_lora_alpha(params), 4)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    pipe.load_lora_weights(tmp_path, weight_name=written[0].name)
    pipe.fuse_lora()
    after = merged(unet)
    for name in adapted_modules(unet):
        assert not torch.allclose(weight(unet, name), original.get_submodule(name).weight)  # the base was moved
        assert torch.allclose(pipe.unet.get_submodule(name).weight, weight(after, name), atol=1e-5), name
