"""Checks every family test makes the same way: a tiny build is byte-identical, a denoiser call is
captured from the pipeline's first step, and a LoRA file means what was trained (loaded through
diffusers' own loaders into a fresh pipeline, fused, and its weight change compared with the
in-memory model's).

FAMILIES holds each family's golden numbers for the checks every family passes alike
(tests/test_families.py runs them, a row each): a new family adds a row there, and its module
(tests/test_families_<family>.py) keeps only what is its own."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.lora_formats.lycoris import adapted_modules
from lorapipe.stages.lora_formats.original_names import kohya_name


def tiny_model_fixture(arch: str):
    """A module fixture: the tiny model of `arch` (named as the variable it is assigned to)."""
    @pytest.fixture(scope="module")
    def tiny_model(tiny_models) -> Path:
        return tiny_models(arch)

    return tiny_model


def assert_builds_byte_identically(model: Path, arch: str, again: Path) -> list[str]:
    families.build_tiny_model(again, arch)
    files = sorted(str(p.relative_to(model)) for p in model.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (model / rel).read_bytes() == (again / rel).read_bytes(), rel
    return files


def quiet_pipeline(model: Path):
    """The model's diffusers pipeline as evaluate loads it (the class its model_index.json names, or a
    modular folder's ModularPipeline), without progress bars."""
    from lorapipe.stages.families.modular import load_render_pipeline

    return load_render_pipeline(model, families.for_model(model), None, "cpu")


def block_pipeline(block, **components):
    """A ModularPipeline of one modular block, its components given here, not fetched: the reference a
    modular-only model's family is compared with, block by block."""
    pipe = block.init_pipeline()
    pipe.update_components(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def first_call(module: torch.nn.Module, run) -> tuple[tuple, dict, object]:
    """The args, kwargs and output of the first call of `module` while `run()` runs."""
    seen = []

    def hook(_, args, kwargs, output):
        if not seen:
            seen.append((args, kwargs, output))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


def encoded_clip(model: Path, pipe, frames: int, height: int, width: int):
    """A seeded clip in [-1, 1] (1, 3, F, H, W) through the family's latent encoder, checked to be the
    pipeline VAE's posterior: the family, its encoder, the clip and the posterior's mean."""
    family = families.for_model(model)
    encoder = family.load_latent_encoder(model, "cpu")
    clip = torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = encoder(clip)
    assert mean.shape == std.shape
    with torch.no_grad():
        assert torch.equal(mean, pipe.vae.encode(clip).latent_dist.mode())
    return family, encoder, clip, mean


def assert_shift_is_the_schedulers(model: Path, mu_of: Callable[[int], float]):
    """The objective's shifted sigmas are the scheduler's, at `mu_of(image tokens)` (64 x 48 px and
    1024 x 1024 px at 16 px a token); returns the objective."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    objective = families.for_model(model).objective(model, ObjectiveParams())
    u = torch.tensor([0.9, 0.5, 0.1])
    for tokens in (12, 4096):
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
        scheduler.set_timesteps(sigmas=u.tolist(), mu=mu_of(tokens))
        assert torch.allclose(objective.shifted(u, tokens), scheduler.sigmas[:-1])
    return objective


def trained_lora(family, model: Path, targets: str | tuple[str, ...], alpha: float = 3.0, rank: int = 4):
    """The tiny denoiser with a LoRA whose up weights are not zero (as after training)."""
    from peft import LoraConfig

    denoiser = family.load_denoiser(model, torch.float32)
    if isinstance(targets, str):
        targets = family.lora_target_modules(denoiser, targets)
    denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                    init_lora_weights="gaussian"))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return denoiser, list(targets)


def fused_change(pipe, denoiser: str, lora: Path | dict, **load_kwargs) -> dict[str, torch.Tensor]:
    """Each Linear's weight change after load_lora_weights (with `load_kwargs`) + fuse_lora of
    `denoiser` in `pipe` (fresh)."""
    model = getattr(pipe, denoiser)
    base = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    file = {"pretrained_model_name_or_path_or_dict": lora.parent, "weight_name": lora.name} \
        if isinstance(lora, Path) else {"pretrained_model_name_or_path_or_dict": lora}
    pipe.load_lora_weights(**file, **load_kwargs)
    pipe.fuse_lora(components=[denoiser])
    return {n: m.weight.detach() - base[n] for n, m in model.named_modules() if n in base}


def assert_means_what_was_trained(denoiser, targets: list[str], change: dict[str, torch.Tensor]) -> None:
    """Every trained module changed by its B @ A x scale, every other Linear not at all."""
    for name, delta in change.items():
        trained = denoiser.get_submodule(name).get_delta_weight("default") if name in targets else 0 * delta
        assert torch.allclose(delta, trained, atol=1e-6), name



def assert_loads_key_for_key(pipe, file: Path) -> None:
    """Every key of the diffusers file lands on a LoRA weight of its value in the pipeline's
    transformer (load_lora_weights), nothing unexpected, nothing missing."""
    pipe.load_lora_weights(file.parent, weight_name=file.name, adapter_name="x")
    loaded = {f"transformer.{k.replace('.x.', '.')}": v for k, v in pipe.transformer.state_dict().items() if ".x." in k}
    tensors = load_file(file)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)

def keys_of(file: Path) -> set[str]:
    """The tensor names a safetensors file holds."""
    with safe_open(file, "pt") as f:
        return set(f.keys())


def respelled_as_kohya(file: Path, out: Path) -> Path:
    """The same tensors under kohya's spelling of the same original names (`diffusion_model.a.b.lora_A
    .weight` -> `lora_unet_a_b.lora_down.weight`): ComfyUI's key map registers both spellings for
    every weight, and some diffusers converters read only this one."""
    spelling = {".lora_A.weight": ".lora_down.weight", ".lora_B.weight": ".lora_up.weight", ".alpha": ".alpha",
                ".dora_scale": ".dora_scale"}
    renamed = {}
    for key, value in load_file(file).items():
        suffix = next(s for s in spelling if key.endswith(s))
        renamed[kohya_name(key.removeprefix("diffusion_model.").removesuffix(suffix)) + spelling[suffix]] = value
    save_file(renamed, out)
    return out


def merged(denoiser) -> torch.nn.Module:
    """A copy of the denoiser with peft's own merge of its adapter into every adapted weight."""
    copied = copy.deepcopy(denoiser)
    for name in adapted_modules(copied):
        copied.get_submodule(name).merge()
    return copied


def weight(denoiser, module: str) -> torch.Tensor:
    """A module's (base) weight, whether or not it carries an adapter."""
    layer = denoiser.get_submodule(module)
    return getattr(layer, "base_layer", layer).weight.detach()


CAPTIONS = ["a photo of a tabby cat looking to the side", "a rocket", ""]  # of three lengths, one empty
EVERY_LINEAR = "every Linear"  # a LoRA target: every Linear of the denoiser, inside the blocks or not
DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
                                            "pytorch_lora_weights_comfyui.safetensors")


@dataclass(frozen=True)
class FamilyRow:
    """A family's golden numbers: the modules each LoRA preset adds to the one before (attention,
    attention_ff, all_linear: each preset the sorted names of the previous one's and its own), the
    files export_lora writes, in order, and the targets of the LoRA they are exported from."""

    arch: str  # the tiny model's
    attention: frozenset[str]
    feed_forward: frozenset[str]
    modulation: frozenset[str]  # what all_linear adds: the blocks' other Linear layers, if any
    exports: tuple[str, ...]
    lora_targets: str = "all_linear"  # a preset, or EVERY_LINEAR

    def __str__(self) -> str:
        return self.arch


def _names(pattern: str, **each: tuple) -> frozenset[str]:
    """Every name `pattern` formats with one value of each keyword: _names("b.{i}.{m}", i=(0, 1), m=("q", "k"))."""
    names = [{}]
    for key, values in each.items():
        names = [{**n, key: v} for n in names for v in values]
    return frozenset(pattern.format(**n) for n in names)


TWO = range(2)
QKVO = ("to_q", "to_k", "to_v", "to_out.0")
JOINT_ATTENTION = (*QKVO, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")  # image and text streams
FLUX1_ATTENTION = (_names("transformer_blocks.0.attn.{m}", m=JOINT_ATTENTION)
                   | _names("single_transformer_blocks.0.attn.{m}", m=QKVO[:3]))
FLUX1_FEED_FORWARD = (_names("transformer_blocks.0.{m}", m=("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                                            "ff_context.net.2"))
                      | {"single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"})
FAMILIES = (
    FamilyRow("flux1", FLUX1_ATTENTION, FLUX1_FEED_FORWARD,
              frozenset({"transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
                         "single_transformer_blocks.0.norm.linear"}),
              (DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE)),
    FamilyRow("chroma", FLUX1_ATTENTION, FLUX1_FEED_FORWARD, frozenset(),  # its modulation is outside the blocks
              (DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE)),
    FamilyRow("z-image",
              _names("{b}.attention.{m}", b=("layers.0", "layers.1", "noise_refiner.0", "context_refiner.0"), m=QKVO),
              _names("{b}.feed_forward.{w}", b=("layers.0", "layers.1", "noise_refiner.0", "context_refiner.0"),
                     w=("w1", "w2", "w3")),
              _names("{b}.adaLN_modulation.0", b=("layers.0", "layers.1", "noise_refiner.0")),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("flux2-klein",
              _names("transformer_blocks.0.attn.{m}", m=JOINT_ATTENTION)
              | _names("single_transformer_blocks.0.attn.{m}", m=("to_qkv_mlp_proj", "to_out")),
              _names("transformer_blocks.0.{m}.{io}", m=("ff", "ff_context"), io=("linear_in", "linear_out")),
              frozenset(),
              (DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE)),
    FamilyRow("flux3",  # the text and image mode blocks (not the reference images'), then the single blocks
              _names("{b}.0.attn.{m}", b=("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks"), m=QKVO),
              _names("{b}.0.ff.{io}", b=("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks"),
                     io=("linear_in", "linear_out")),
              frozenset(),  # the modulation is per stream, outside the blocks
              (DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE)),
    FamilyRow("flux2-dev",  # Klein's transformer with the guidance input, outside the blocks
              _names("transformer_blocks.0.attn.{m}", m=JOINT_ATTENTION)
              | _names("single_transformer_blocks.0.attn.{m}", m=("to_qkv_mlp_proj", "to_out")),
              _names("transformer_blocks.0.{m}.{io}", m=("ff", "ff_context"), io=("linear_in", "linear_out")),
              frozenset(),
              (DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE)),
    FamilyRow("qwen-image",
              _names("transformer_blocks.{i}.attn.{m}", i=TWO, m=JOINT_ATTENTION),
              _names("transformer_blocks.{i}.{m}.net.{p}", i=TWO, m=("img_mlp", "txt_mlp"), p=("0.proj", "2")),
              _names("transformer_blocks.{i}.{m}.1", i=TWO, m=("img_mod", "txt_mod")),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("qwen-image-2.1",
              _names("transformer_blocks.{i}.attn.{m}", i=TWO, m=QKVO),
              _names("transformer_blocks.{i}.img_mlp.{m}", i=TWO, m=("gate_layer", "proj", "out")),
              frozenset(),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("krea2",
              _names("transformer_blocks.{i}.attn.{m}", i=TWO, m=("to_q", "to_k", "to_v", "to_gate", "to_out.0")),
              _names("transformer_blocks.{i}.ff.{m}", i=TWO, m=("gate", "up", "down")),
              frozenset(),
              (DIFFUSERS_FILE, COMFYUI_FILE), lora_targets=EVERY_LINEAR),  # text fusion and embedders too
    FamilyRow("ideogram4",
              _names("layers.{i}.attention.{m}", i=TWO, m=QKVO),
              _names("layers.{i}.feed_forward.{m}", i=TWO, m=("w1", "w2", "w3")),
              _names("layers.{i}.adaln_modulation", i=TWO),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("wan2.1",
              _names("blocks.{i}.{a}.{m}", i=TWO, a=("attn1", "attn2"), m=QKVO),
              _names("blocks.{i}.ffn.net.{p}", i=TWO, p=("0.proj", "2")),
              frozenset(),  # a block has no other Linear
              (DIFFUSERS_FILE, KOHYA_FILE, COMFYUI_FILE)),
    FamilyRow("hunyuanvideo1.5",
              _names("transformer_blocks.{i}.attn.{m}", i=TWO, m=JOINT_ATTENTION),
              _names("transformer_blocks.{i}.{m}.net.{p}", i=TWO, m=("ff", "ff_context"), p=("0.proj", "2")),
              _names("transformer_blocks.{i}.{m}.linear", i=TWO, m=("norm1", "norm1_context")),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("ernie-image",
              _names("layers.{i}.self_attention.{m}", i=TWO, m=QKVO),
              _names("layers.{i}.mlp.{m}", i=TWO, m=("gate_proj", "up_proj", "linear_fc2")),
              frozenset(),  # the modulation is shared, outside the blocks
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("hunyuanimage2.1",  # Flux.1's module names in its blocks
              _names("transformer_blocks.{i}.attn.{m}", i=TWO, m=JOINT_ATTENTION)
              | _names("single_transformer_blocks.{i}.attn.{m}", i=TWO, m=QKVO[:3]),
              _names("transformer_blocks.{i}.{m}.net.{p}", i=TWO, m=("ff", "ff_context"), p=("0.proj", "2"))
              | _names("single_transformer_blocks.{i}.{m}", i=TWO, m=("proj_mlp", "proj_out")),
              _names("transformer_blocks.{i}.{m}.linear", i=TWO, m=("norm1", "norm1_context"))
              | _names("single_transformer_blocks.{i}.norm.linear", i=TWO),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    FamilyRow("hidream-i1",  # the image feed-forward mixes a shared and 4 routed experts (its router is no Linear)
              _names("double_stream_blocks.{i}.block.attn1.{m}{t}", i=TWO, m=("to_q", "to_k", "to_v", "to_out"),
                     t=("", "_t"))
              | _names("single_stream_blocks.{i}.block.attn1.{m}", i=TWO, m=("to_q", "to_k", "to_v", "to_out")),
              _names("{s}_stream_blocks.{i}.block.ff_i.{e}.{w}", s=("double", "single"), i=TWO,
                     e=("shared_experts", "experts.0", "experts.1", "experts.2", "experts.3"), w=("w1", "w2", "w3"))
              | _names("double_stream_blocks.{i}.block.ff_t.{w}", i=TWO, w=("w1", "w2", "w3")),
              _names("{s}_stream_blocks.{i}.block.adaLN_modulation.1", s=("double", "single"), i=TWO),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    KANDINSKY5 := FamilyRow("kandinsky5",  # its text blocks (in the transformer) as its visual ones
              _names("text_transformer_blocks.0.self_attention.{m}", m=("to_query", "to_key", "to_value", "out_layer"))
              | _names("visual_transformer_blocks.{i}.{a}.{m}", i=TWO, a=("self_attention", "cross_attention"),
                       m=("to_query", "to_key", "to_value", "out_layer")),
              _names("{b}.feed_forward.{m}", b=("text_transformer_blocks.0", "visual_transformer_blocks.0",
                                                "visual_transformer_blocks.1"), m=("in_layer", "out_layer")),
              _names("{b}.{m}_modulation.out_layer", b=("text_transformer_blocks.0",), m=("text",))
              | _names("visual_transformer_blocks.{i}.visual_modulation.out_layer", i=TWO),
              (DIFFUSERS_FILE, COMFYUI_FILE)),
    replace(KANDINSKY5, arch="kandinsky5-video"), replace(KANDINSKY5, arch="kandinsky5-i2v"),  # the same transformer
    FamilyRow("ltx2",
              _names("transformer_blocks.{i}.{a}.{m}", i=TWO, a=("attn1", "attn2"), m=QKVO),
              _names("transformer_blocks.{i}.ff.net.{p}", i=TWO, p=("0.proj", "2")),
              frozenset(),  # no audio module: a video loss leaves them untrained
              (DIFFUSERS_FILE, COMFYUI_FILE)),
)
FAMILIES += tuple(replace(row, arch=f"{row.arch}-i2v") for row in FAMILIES  # the same transformer, another pipeline
                  if row.arch == "hunyuanvideo1.5")
FAMILIES += tuple(replace(row, arch="ltx2.5",  # LTX-2.3's blocks: LTX-2's modules and each attention's gate
                          modulation=_names("transformer_blocks.{i}.{a}.to_gate_logits", i=TWO, a=("attn1", "attn2")))
                  for row in FAMILIES if row.arch == "ltx2")


def text_records(model: Path, captions: list[str], options: TextOptions = TextOptions()):
    """The family of `model` and the text records its encoder makes of `captions` (float32, CPU)."""
    family = families.for_model(model)
    return family, family.text_encoder(model, family.text_settings(model, options), torch.float32, "cpu")(captions)


def exported_lora(model: Path, targets: str, out: Path):
    """The tiny denoiser with a trained LoRA on `targets` (a preset or EVERY_LINEAR), the targets,
    and the files its family's export_lora writes into `out`."""
    family = families.for_model(model)
    if targets == EVERY_LINEAR:
        denoiser = family.load_denoiser(model, torch.float32)
        targets = tuple(sorted(n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)))
    denoiser, targets = trained_lora(family, model, targets)
    return denoiser, targets, family.export_lora(denoiser, out, {"lorapipe.steps": "1"}, {"ss_network_alpha": "3.0"})


def assert_padded_per_batch_as_the_pipeline(family, records: list[dict], embeds: torch.Tensor, mask) -> None:
    """The unpadded records, padded per batch by the family, are the pipeline's embeddings and mask;
    the mask is left out, as the pipeline leaves it out, when nothing in the batch is padded."""
    cond = family.conditioning(records, [], ObjectiveParams())
    assert torch.equal(cond["encoder_hidden_states"], embeds)
    if mask is None:
        assert "encoder_hidden_states_mask" not in cond and len(records) == 1
    else:
        assert torch.equal(cond["encoder_hidden_states_mask"], mask.bool())
        assert [r["hidden_states"].shape[0] for r in records] == mask.sum(1).tolist()


def assert_resolution_shift_is_the_pipelines(model: Path, calculate_shift, *shift_params: float) -> None:
    """The objective shifts by resolution as the pipeline does: mu = calculate_shift(image tokens,
    *shift_params) (base and max sequence length, base and max shift), the last its max_shift."""
    objective = assert_shift_is_the_schedulers(model, lambda tokens: calculate_shift(tokens, *shift_params))
    assert (objective.sampling.shift, objective.sampling.max_shift) == ("resolution", shift_params[-1])


def assert_records_are_the_pipelines_at_their_own_tokens(family, records: list[dict], embeds: torch.Tensor,
                                                         own: torch.Tensor, atol: float = 0.0) -> None:
    """Each record is the pipeline's (batch-padded) embeddings at its own tokens (`own`, the mask of
    them: some padded), to `atol`; padded per batch, the family's attention mask marks as many."""
    assert not own.all()
    for record, embed, mine in zip(records, embeds, own, strict=True):
        assert record["hidden_states"].shape == embed[mine].shape
        assert torch.allclose(record["hidden_states"], embed[mine], rtol=0, atol=atol)
    cond = family.conditioning(records, [], ObjectiveParams())
    assert cond["encoder_attention_mask"].sum(1).tolist() == own.sum(1).tolist()


def first_step_predicted(model: Path, captions: list[str], unpack: Callable, options: TextOptions = TextOptions(),
                         **call):
    """The pipeline's first transformer call on `captions` (two steps, seed 0, latent output, `call`'s
    arguments) and family.predict on its noisy latents (`unpack(pipe, kwargs)`), the family's text
    records (`options`) and the scheduler's first sigma: (noisy, predicted, the call's output, its
    kwargs, the pipeline)."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        captions, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", **call))
    cond = family.conditioning(text_records(model, captions, options)[1], [], ObjectiveParams())
    noisy = unpack(pipe, kwargs)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, pipe.scheduler.sigmas[0].expand(len(captions)), cond,
                                   torch.float32)
    return noisy, predicted, output, kwargs, pipe


def assert_text_and_glyph_records_are_encode_prompts(model: Path, captions: list[str]) -> None:
    """A Hunyuan family's records are encode_prompt's Qwen2.5-VL states and ByT5 states at the caption's
    own tokens (captions[0] quotes text; the others, quoting none, have no ByT5 token); padded per
    batch by the family, with masks counting them."""
    family, records = text_records(model, captions)
    pipe = quiet_pipeline(model)
    with torch.no_grad():
        embeds, mask, glyphs, glyph_mask = pipe.encode_prompt(captions, device="cpu", batch_size=len(captions))
    for record, embed, own, glyph, own_glyph in zip(records, embeds, mask.bool(), glyphs, glyph_mask.bool()):
        assert torch.equal(record["hidden_states"], embed[own])
        assert torch.equal(record["glyph_states"], glyph[own_glyph])
    assert [len(r["glyph_states"]) for r in records][1:] == [0] * (len(captions) - 1)
    assert len(records[0]["glyph_states"]) > 0
    cond = family.conditioning(records, [], ObjectiveParams())
    assert cond["encoder_attention_mask"].sum(1).tolist() == mask.sum(1).tolist()
    assert cond["encoder_attention_mask_2"].sum(1).tolist() == glyph_mask.sum(1).tolist()


def assert_only_the_guiders_scale_renders(model: Path, guider_scale: float) -> None:
    """A pipeline that guides at its guider's scale takes none in the call: another is refused, not ignored."""
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions())
    assert family.render_kwargs(settings, guider_scale, "blurry") == {"negative_prompt": "blurry"}
    with pytest.raises(ValueError, match=f"evaluate.guidance_scale: {family.pipeline_class} guides at its guider's"):
        family.render_kwargs(settings, guider_scale + 0.5, "")
