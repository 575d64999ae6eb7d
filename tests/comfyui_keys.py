"""What ComfyUI does with a LoRA file, restated from its source (comfy/lora.py `model_lora_keys_unet`
and `load_lora`, comfy/utils.py's `unet_to_diffusers`, `flux_to_diffusers`, `z_image_to_diffusers`,
comfy/weight_adapter/*; read, not run: ComfyUI is not installable here) for the tiny models, so a
test can load a file as ComfyUI would and see which keys it leaves unread and what each weight
becomes.

ComfyUI's model holds the original checkpoint layout, the one diffusers' single-file converters
read: its weights, and the rows of each that a diffusers module is, come from those converters
(`original_names` of the family modules, all Linear layers; ldm_names.py for the UNet). Its key map
is modelled on ComfyUI 0a674689 (2025-11-29), the version STACK-NOTES records; later versions add
names (Z-Image's and Flux.2's diffusers names under `transformer.`), which no file of ours uses:
- every model: `diffusion_model.<original>` and `lora_unet_<original with _>`;
- UNet models: diffusers names as `lora_unet_<name with _>`, `lycoris_<...>`, and the old diffusers
  attention-processor spelling (`[unet.]<block>.processor.to_q`), not peft's `unet.<module>`;
- Flux: Flux.1's diffusers names under `transformer.` (and `lycoris_`, `lora_transformer_`, bare),
  each onto its rows of the fused weight, for Chroma too (a Flux model there); not modelled for Flux.2,
  whose names that table lacked;
- Z-Image (ComfyUI's Lumina2): diffusers names under `diffusion_model.` (and `lycoris_`, bare) onto
  their rows of the fused weights (`transformer.` only in later versions);
- Qwen-Image: its (diffusers-named) weights bare, under `transformer.` and `lycoris_`;
- Wan: no table of its own (its model holds Wan's original names, `blocks.N.self_attn.q`): only the
  two names every model has, so diffusers-named Wan files are not modelled as read;
- HunyuanVideo (1.0, and 1.5, its subclass there): its model holds its own names, Flux's double
  blocks' (`double_blocks.N.img_attn.qkv`, `img_mlp.0`, `img_mod.lin`), not Tencent's; lora.py maps
  each, renamed to Tencent's spelling (`img_attn_qkv`, `img_mlp.fc1`, `img_mod.linear`), under
  `transformer.` and `diffusion_model.` (diffusion-pipe's files).
A module's tensors are read by ComfyUI's suffixes (`lora_up/lora_down`, `lora_B/lora_A`, `alpha`,
`dora_scale`, `hada_*`, `lokr_*`); a file without `.alpha` is applied at scale 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
from family_checks import merged, weight
from safetensors.torch import load_file

from lorapipe.stages.families import flux1, flux2, zimage
from lorapipe.stages.families.ldm_names import unet_original_names
from lorapipe.stages.lora_formats.lycoris import adapted_modules
from lorapipe.stages.lora_formats.original_names import OriginalNames, kohya_name

LORA_PAIRS = (("lora_up.weight", "lora_down.weight"), ("lora_B.weight", "lora_A.weight"))  # (up, down)
LYCORIS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2",
           "lokr_w2_a", "lokr_w2_b")
TABLES = {"sd15": "unet", "sdxl": "unet", "flux1": "flux", "z-image": "lumina2", "qwen-image": "qwen",
          "chroma": "flux",  # ComfyUI's Chroma model is a Flux model
          "hunyuanvideo1.5": "hunyuan_video", "hunyuanvideo1.5-i2v": "hunyuan_video"}
# lora.py's renames of a HunyuanVideo model's names into the keys it reads (Tencent's spelling)
HUNYUAN_VIDEO_RENAMES = (("_mod.lin.", "_mod.linear."), ("_attn.qkv.", "_attn_qkv."), ("_attn.proj.", "_attn_proj."),
                         ("mlp.0.", "mlp.fc1."), ("mlp.2.", "mlp.fc2."), (".modulation.lin.", ".modulation.linear."))


@dataclass(frozen=True)
class Target:
    """Rows [start, end) (fractions) of a weight of ComfyUI's model."""

    original: str
    start: Fraction = Fraction(0)
    end: Fraction = Fraction(1)


@dataclass(frozen=True)
class ComfyUIModel:
    layout: OriginalNames  # ComfyUI's weights (original names) and the diffusers modules' rows in each
    key_map: dict[str, Target]  # a LoRA key prefix -> what ComfyUI patches with it

    def load(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[Target, dict]], set[str]]:
        """ComfyUI's `load_lora`: prefix -> (its target, its tensors as `lora_A.weight`, `lora_B.weight`,
        `alpha`, `dora_scale`, `hada_*`, `lokr_*`), and the keys it leaves unread."""
        patches, read = {}, set()
        for prefix, target in self.key_map.items():
            found = {}
            for up, down in LORA_PAIRS:
                if f"{prefix}.{up}" in tensors:
                    found.update({"lora_B.weight": f"{prefix}.{up}", "lora_A.weight": f"{prefix}.{down}"})
                    break
            found.update({name: f"{prefix}.{name}" for name in (*LYCORIS, "alpha", "dora_scale")
                          if f"{prefix}.{name}" in tensors})
            if set(found) - {"alpha", "dora_scale"}:
                patches[prefix] = (target, {name: tensors[key] for name, key in found.items()})
                read |= set(found.values())
        return patches, set(tensors) - read


def comfyui_model(family, denoiser: torch.nn.Module) -> ComfyUIModel:
    """ComfyUI's model and key map for the family's denoiser (see the module docstring)."""
    layout = _layout(family, denoiser)
    table = TABLES.get(family.name)
    if table == "hunyuan_video":  # the model's own names, which the file's (Tencent's) are renamed from
        layout = {_renamed(f"{name}.", HUNYUAN_VIDEO_RENAMES, back=True)[:-1]: rows for name, rows in layout.items()}
    key_map = {}
    for original in layout:
        key_map[f"diffusion_model.{original}"] = key_map[kohya_name(original)] = Target(original)
        if table == "hunyuan_video":
            read_as = _renamed(f"{original}.", HUNYUAN_VIDEO_RENAMES)[:-1]
            key_map[f"transformer.{read_as}"] = key_map[f"diffusion_model.{read_as}"] = Target(original)
    for original, segments in layout.items():
        for s in segments:
            if [t.module for t in segments].count(s.module) == 1:  # one run of rows (not a swapped pair)
                for key in _diffusers_keys(table, s.module):
                    key_map[key] = Target(original, s.start, s.end)
    return ComfyUIModel(layout, key_map)


def _renamed(name: str, renames: tuple[tuple[str, str], ...], back: bool = False) -> str:
    for old, new in renames:
        name = name.replace(new, old) if back else name.replace(old, new)
    return name


def _layout(family, denoiser) -> OriginalNames:
    config = denoiser.config
    linear = sorted({n.removesuffix(".base_layer") for n, m in denoiser.named_modules()  # the model's own layers
                     if isinstance(m, torch.nn.Linear) and ".lora_" not in n})
    if family.name in ("sd15", "sdxl"):
        return unet_original_names(dict(config), linear)
    if family.name == "flux1":
        return flux1.original_names(config.num_layers, config.num_single_layers, config.guidance_embeds)
    if family.name in ("flux2-klein", "flux2-dev"):
        return flux2.original_names(config.num_layers, config.num_single_layers, config.guidance_embeds)
    if family.name == "z-image":
        return zimage.original_names(config.n_layers, config.n_refiner_layers)
    return family.original_names(denoiser)  # Qwen-Image (the diffusers names are the original ones), Wan


def _diffusers_keys(table: str | None, module: str) -> list[str]:
    """The key prefixes under which ComfyUI's model-specific table maps diffusers module `module`."""
    flat = module.replace(".", "_")
    if table == "unet":
        old = module.replace(".to_", ".processor.to_")
        old = old.removesuffix(".0") if old.endswith(".to_out.0") else old
        return [kohya_name(module), f"lycoris_{flat}", old, f"unet.{old}"]
    if table == "flux":
        return [f"transformer.{module}", f"lycoris_{flat}", f"lora_transformer_{flat}", module]
    if table == "lumina2":
        return [f"diffusion_model.{module}", f"lycoris_{flat}", module]
    if table == "qwen":
        return [module, f"transformer.{module}", f"lycoris_{flat}"]
    return []


def in_original_layout(denoiser, segments) -> torch.Tensor:
    """An original module's weight, assembled from the diffusers modules' rows it is made of."""
    parts = [(s, weight(denoiser, s.module)) for s in segments]
    rows = sum(int((s.part_end - s.part_start) * w.shape[0]) for s, w in parts)
    out = torch.empty(rows, *parts[0][1].shape[1:])
    for s, w in parts:
        n = w.shape[0]
        out[int(s.start * rows):int(s.end * rows)] = w[int(s.part_start * n):int(s.part_end * n)]
    return out


def comfyui_weight(base: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight ComfyUI makes of `base` and one module's tensors `t` (as `ComfyUIModel.load` names
    them), written from the formats' documented rules, not from our exporter."""
    alpha = t["alpha"].item() if "alpha" in t else None
    if "lora_A.weight" in t:
        down, up = t["lora_A.weight"], t["lora_B.weight"]
        diff = (up.flatten(1) @ down.flatten(1)) * (alpha / down.shape[0] if alpha is not None else 1.0)
    elif "hada_w1_a" in t:
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * scale
    else:
        dims = [t[f"lokr_{w}_b"].shape[0] for w in ("w1", "w2") if f"lokr_{w}_b" in t]
        w1, w2 = (t[f"lokr_{w}"] if f"lokr_{w}" in t else t[f"lokr_{w}_a"] @ t[f"lokr_{w}_b"] for w in ("w1", "w2"))
        diff = torch.kron(w1, w2) * (alpha / dims[-1] if dims and alpha is not None else 1.0)
    new = base + diff.reshape(base.shape)
    return weight_decompose(t["dora_scale"], base, new) if "dora_scale" in t else new


def weight_decompose(dora_scale: torch.Tensor, base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """ComfyUI's DoRA at strength 1 (comfy/weight_adapter/base.py `weight_decompose`, computed in
    float32): a `dora_scale` with one value per row of the weight is an output-axis magnitude, and
    divides by the *base* weight's row norms; any other is an input-axis one, and divides by the
    adapted weight's column norms. Each norm gets float32's eps."""
    eps = torch.finfo(torch.float32).eps
    if dora_scale.shape[0] == new.shape[0]:
        norm = base.reshape(base.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (base.dim() - 1))
    else:
        norm = new.transpose(0, 1).reshape(new.shape[1], -1).norm(dim=1)
        norm = norm.reshape(new.shape[1], *[1] * (new.dim() - 1)).transpose(0, 1)
    return new * (dora_scale / (norm + eps))


def assert_comfyui_applies_the_merged_model(file: Path, denoiser, family, base_model=None) -> None:
    """ComfyUI reads every key of `file`, patches every adapted module, and each patched weight,
    recomputed from the file's tensors on the base weights (`base_model`'s where given: the original
    model a PiSSA/OLoRA adapter's export applies to), equals peft's merged weight."""
    model, after, base_model = comfyui_model(family, denoiser), merged(denoiser), base_model or denoiser
    patches, unread = model.load(load_file(file))
    assert not unread, f"ComfyUI leaves {len(unread)} keys unread: {sorted(unread)[:3]}"
    covered = set()
    for prefix, (target, t) in patches.items():
        segments = model.layout[target.original]
        base, expected = in_original_layout(base_model, segments), in_original_layout(after, segments)
        rows = slice(int(target.start * base.shape[0]), int(target.end * base.shape[0]))
        assert torch.allclose(comfyui_weight(base[rows], t), expected[rows], atol=1e-5), prefix
        covered |= {s.module for s in segments if target.start <= s.start and s.end <= target.end}
    missing = sorted(set(adapted_modules(denoiser)) - covered)
    assert not missing, f"ComfyUI patches no weight for {missing[:3]}"


def comfyui_unread(file: Path, denoiser, family) -> set[str]:
    """The keys of `file` ComfyUI leaves unread (it warns "lora key not loaded" for each)."""
    return comfyui_model(family, denoiser).load(load_file(file))[1]
