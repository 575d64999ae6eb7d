"""Block swap on the CPU: a swapped block holds its frozen weights only while it runs (empty tensors
otherwise), and a LoRA step computes the same loss and gradients, bit for bit, with and without the
swap, with and without gradient checkpointing, for every transformer family's blocks (its
block_lists, families.swappable_blocks). Through the train stage (the tiny Flux.1 and its encoded
demo photos): the same losses and LoRA files as without it, in one process and under 2-process
DDP; where it cannot apply, one line naming train.blocks_to_swap before training starts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from parallel import trained_ahead
from safetensors.torch import load_file

from lorapipe.cache.errors import UserError
from lorapipe.stages import families, train
from lorapipe.stages.train.block_swap import BlockSwap, swap_count
from lorapipe.stages.train.checkpointing import enable_gradient_checkpointing
from lorapipe.stages.train.launch import check_block_swap


def flux_transformer(checkpointing: bool, dropout: float = 0.0):
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", lora_dropout=dropout,
                                 target_modules=["to_q", "to_k", "to_v", "proj_mlp", "proj_out"]))
    if checkpointing:
        enable_gradient_checkpointing(model)
    return model.train()


def blocks(model) -> list[torch.nn.Module]:
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def step(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = model(hidden_states=torch.randn(2, 16, 16, generator=g), encoder_hidden_states=torch.randn(2, 4, 16, generator=g),
                pooled_projections=torch.randn(2, 16, generator=g), timestep=torch.tensor([0.3, 0.7]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), return_dict=False)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("count", [1, 3])
def test_a_swapped_step_is_bit_for_bit_the_plain_one(checkpointing, count):
    plain = step(flux_transformer(checkpointing))
    model = flux_transformer(checkpointing)
    swap = BlockSwap(blocks(model), count, torch.device("cpu"))
    swapped_blocks = blocks(model)[-count:]
    for _ in range(2):  # a second step: the weights came back intact
        loss, grads = step(model)
        assert torch.equal(loss, plain[0]) and all(torch.equal(a, b) for a, b in zip(grads, plain[1]))
        frozen = [p for b in swapped_blocks for p in b.parameters() if not p.requires_grad]
        assert frozen and all(p.numel() == 0 for p in frozen)  # off between steps
    swap.remove()
    assert all(p.numel() for p in model.parameters())
    assert torch.equal(step(model)[0], plain[0])


@dataclass(frozen=True)
class Geometry:
    """What a family's conditioning may read of a sample (families.base.ImageGeometry)."""

    original_size: tuple[int, int] = (64, 64)
    crop_box: tuple[int, int, int, int] = (0, 0, 64, 64)
    size: tuple[int, int] = (64, 64)
    resized: tuple[int, int] | None = None
    fps: float = 16.0


@pytest.fixture(scope="module")
def denoiser_step_inputs(tiny_models):
    """arch -> (model folder, its family, a 2-sample batch: noisy latents, sigmas, conditioning), made
    through the family's own text encoder and VAE on its tiny model (a 5-frame clip for video)."""
    made = {}

    def inputs(arch: str):
        if arch not in made:
            model = tiny_models(arch)
            family = families.for_model(model)
            texts = family.text_encoder(model, family.text_settings(model, families.TextOptions()),
                                             torch.float32, "cpu")(["a red ball", "a blue sky over a field"])
            frames = (5,) if family.frames_problem(model, 5) is None else ()
            pixels = torch.rand(2, 3, *frames, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
            latents = family.latent_normalisation(model).apply(family.load_latent_encoder(model, "cpu")(pixels)[0])
            cond = family.conditioning(texts, [(Geometry(), False)] * 2, families.ObjectiveParams())
            made[arch] = model, family, (torch.randn_like(latents), torch.tensor([0.3, 0.8]), cond)
        return made[arch]

    return inputs


# Where one block's output feeds several later blocks (Kandinsky 5's text blocks: every visual block
# reads their output), a full backward hook on the blocks, BlockSwap's or one that does nothing, changes
# the order the gradients reaching that output are summed in: its swapped step is compared bit for bit
# with an unswapped step under hooks that do nothing, and to float rounding with a plain one.
HOOKS_REORDER_SUMS = {"kandinsky5"}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("arch", ["flux1", "flux2-klein", "z-image", "qwen-image", "qwen-image-2.1", "krea2",
                                  "ideogram4", "wan2.1", "wan2.2-5b", "ltx2", "ernie-image", "chroma", "flux2-dev",
                                  "flux3", "hidream-i1", "hunyuanimage2.1", "kandinsky5", "hunyuanvideo1.5"])
def test_every_transformer_familys_blocks_swap_bit_for_bit(arch, checkpointing, denoiser_step_inputs):
    from peft import LoraConfig

    model, family, (noisy, sigmas, cond) = denoiser_step_inputs(arch)

    def lora_step(swap: bool, hooked: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        denoiser = family.load_denoiser(model, torch.float32).requires_grad_(False)
        torch.manual_seed(0)
        denoiser.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                        target_modules=family.lora_target_modules(denoiser, "all_linear")))
        if checkpointing:
            enable_gradient_checkpointing(denoiser)
        blocks = families.swappable_blocks(family, denoiser)
        if swap:
            BlockSwap(blocks, len(blocks), torch.device("cpu"))
        for block in blocks if hooked else ():
            block.register_full_backward_pre_hook(lambda *_: None)
        loss = family.predict(denoiser.train(), noisy, sigmas, cond, torch.float32).pow(2).mean()
        loss.backward()
        frozen = [p for block in blocks for p in block.parameters() if not p.requires_grad]
        assert frozen and all(p.numel() == 0 for p in frozen) == swap  # the family's blocks, off between uses
        return loss.detach(), [p.grad for p in denoiser.parameters() if p.requires_grad]  # None: an unused layer

    (plain_loss, plain_grads), (loss, grads) = lora_step(False, arch in HOOKS_REORDER_SUMS), lora_step(True)
    assert torch.equal(loss, plain_loss)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    if arch in HOOKS_REORDER_SUMS:
        unhooked_loss, unhooked_grads = lora_step(False)
        assert torch.equal(loss, unhooked_loss)
        assert all(a is b is None or torch.allclose(a, b, rtol=1e-5, atol=1e-9)
                   for a, b in zip(grads, unhooked_grads, strict=True))


def test_a_swapped_block_used_without_its_hooks_fails_instead_of_reading_stale_memory():
    model = flux_transformer(False)
    BlockSwap(blocks(model), 1, torch.device("cpu"))
    last = blocks(model)[-1]
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.randn(1, 48), last.proj_out.base_layer.weight)


def test_blocks_to_swap_is_a_count_or_a_fraction_of_the_blocks():
    assert [swap_count(3, 40), swap_count(0.5, 40), swap_count(0.01, 40)] == [3, 20, 1]
    with pytest.raises(UserError, match=r"^train.blocks_to_swap: 5 of 4 blocks; give 1 to 4, or a fraction$"):
        swap_count(5, 4)


def check(family: str, options: dict, **params) -> None:
    check_block_swap(families.get(family), train.TrainParams(**params), train.TrainOptions(**options))


@pytest.mark.parametrize(("family", "params", "refusal"), [
    ("sd15", {}, "Stable Diffusion 1.x/2.x's denoiser has no chain of blocks to swap; remove it"),
    ("wan", {"base_quantization": "int8"}, "not with train.base_quantization int8: a quantised weight cannot"),
    ("flux1", {"init": "pissa"}, "not with train.init pissa, which rewrites the base weights"),
])
def test_block_swap_where_it_cannot_apply_is_refused_in_one_line(family, params, refusal):
    check(family, {}, **params)  # without blocks_to_swap: nothing to refuse
    with pytest.raises(UserError) as refused:
        check(family, {"blocks_to_swap": 1}, **params)
    assert str(refused.value).startswith(f"train.blocks_to_swap: {refusal}") and "\n" not in str(refused.value)


def test_a_unet_refuses_block_swap_before_training_starts(tmp_path, tiny_model, encoded):
    inputs = train.TrainInputs(encoded.artifact_dir, encoded.cache_root, tiny_model, "base", encoded.digest)
    with pytest.raises(UserError, match=r"^train.blocks_to_swap: Stable Diffusion 1.x/2.x's denoiser has no chain"):
        train.run(train.TrainParams(max_steps=1), inputs, tmp_path / "out", tmp_path / "work",
                  train.TrainOptions(blocks_to_swap=1, log_with="none"), log=lambda line: None)
    assert not (tmp_path / "work").exists()  # no training process was started


def train_flux(tmp: Path, name: str, model: Path, encoded, processes: int = 1, placement=None,
               **options) -> tuple[list[float], dict, str]:
    """Four steps of the tiny Flux.1 (a LoRA on every Linear of both its blocks), where `placement`
    says (default: where its settings say): losses, LoRA, log."""
    inputs = train.TrainInputs(encoded.artifact_dir, encoded.cache_root, model, "base", encoded.digest)
    params = train.TrainParams(rank=4, target_modules="all_linear", learning_rate=1e-2, batch_size=2, max_steps=4,
                               checkpoint_every=4, seed=5, num_processes=processes)
    out = tmp / name
    train.run(params, inputs, out, tmp / f"work-{name}", train.TrainOptions(log_with="none", **options),
              log=lambda line: None, placement=placement)
    losses = [json.loads(line)["loss"] for line in (out / "logs" / "loss.jsonl").read_text().splitlines()]
    return losses, load_file(out / "pytorch_lora_weights.safetensors"), (out / "logs" / "train.log").read_text()


@pytest.mark.slow
def test_training_with_block_swap_is_bit_for_bit_training_without(tmp_path, flux_model, flux_encoded):
    """The three trainings one after another in one process started ahead (tests/parallel.py)."""
    with trained_ahead() as placement:
        plain_losses, plain_lora, _ = train_flux(tmp_path, "plain", flux_model, flux_encoded, placement=placement)
        swapped_runs = [(name, swapped, train_flux(tmp_path, name, flux_model, flux_encoded, placement=placement,
                                                   **options))
                        for name, options, swapped in [
                            ("all", {"blocks_to_swap": 2}, 2),
                            ("half-checkpointed", {"blocks_to_swap": 0.5, "gradient_checkpointing": True}, 1)]]
    for name, swapped, (losses, lora, log) in swapped_runs:
        assert f"block swap: the last {swapped} of 2 blocks wait off cpu between their uses" in log
        assert losses == plain_losses, name
        assert lora.keys() == plain_lora.keys() and all(torch.equal(lora[k], plain_lora[k]) for k in lora), name



@pytest.mark.slow
def test_ddp_training_with_block_swap_is_bit_for_bit_ddp_training_without(tmp_path, flux_model, flux_encoded):
    plain_losses, plain_lora, _ = train_flux(tmp_path, "plain", flux_model, flux_encoded, processes=2)
    losses, lora, log = train_flux(tmp_path, "swapped", flux_model, flux_encoded, processes=2, blocks_to_swap=2,
                                   gradient_checkpointing=True)
    assert "rank 1/2" in log and "block swap: the last 2 of 2 blocks wait off cpu" in log
    assert losses == plain_losses and all(torch.equal(lora[k], plain_lora[k]) for k in plain_lora)
