"""Flux.1 through the real preprocess, encode and train stages: the LoRA files the train stage
publishes reproduce the trained transformer when loaded by FluxPipeline.load_lora_weights (the
diffusers file, and the kohya file through diffusers' own kohya-Flux converter); image sides that
are not multiples of 16 px are refused before anything is encoded.

The LoRA covers the double block's attention and feed-forward layers: diffusers 0.42.1's kohya
converter splits single blocks' linear1 at Flux.1's fixed full-size widths, so a tiny single block
cannot load through it (tests/test_families_flux1.py checks single blocks at full width)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lorapipe.cache.errors import UserError
from lorapipe.flows.steps import STAGES
from lorapipe.stages import families

pytestmark = pytest.mark.slow

DEMO_IMAGES = Path(__file__).resolve().parent.parent / "stages" / "assets" / "demo_images"
RANK, ALPHA = 4, 8.0  # alpha != rank: a loader that dropped alpha would apply the wrong strength


def double_block_targets(model: Path) -> list[str]:
    family = families.for_model(model)
    return [name for name in family.lora_target_modules(family.load_denoiser(model, torch.float32), "attention_ff")
            if name.startswith("transformer_blocks.")]


def flux_config(folder: Path, model: Path, resolution: int = 64) -> Path:
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({
        "name": "flux-train", "cache_dir": "cache", "output_dir": "out", "model": {"path": str(model)},
        "data": {"path": str(DEMO_IMAGES)}, "preprocess": {"resolution": resolution, "holdout_fraction": 0.25},
        "encode": {"num_workers": 0},
        "train": {"rank": RANK, "alpha": ALPHA, "target_modules": double_block_targets(model), "learning_rate": 2e-2,
                  "max_steps": 6, "batch_size": 2, "checkpoint_every": 6, "log_with": "none"},
        "evaluate": {"prompts": ["a photo of a cat"], "seeds": [0], "num_inference_steps": 2},
    }))
    return config


def transformer_inputs(family, model: Path) -> tuple:
    """Noisy latents, sigmas and conditioning of the tiny Flux.1 dev's shapes, from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    text = family.text_settings(model, families.TextOptions()).max_sequence_length
    records = [{"hidden_states": torch.randn(text, 32, generator=g), "pooled": torch.randn(32, generator=g)}
               for _ in range(2)]
    cond = family.conditioning(records, [], families.ObjectiveParams())
    return torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.2, 0.9]), cond


def test_published_flux_loras_reproduce_the_trained_transformer(tmp_path, flux_model, run_stages):
    from diffusers import FluxPipeline
    from peft import LoraConfig

    from lorapipe.stages.lora_formats.diffusers_format import load_diffusers_lora

    out = Path(run_stages(flux_config(tmp_path, flux_model), STAGES[:3])["train"][1].path)
    family = families.for_model(flux_model)
    trained = family.load_denoiser(flux_model, torch.float32)
    trained.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=double_block_targets(flux_model)))
    load_diffusers_lora(trained, out / "checkpoints" / "step-000006" / "pytorch_lora_weights.safetensors", "transformer")
    noisy, t, cond = transformer_inputs(family, flux_model)
    with torch.no_grad():
        expected = family.predict(trained.eval(), noisy, t, cond, torch.float32)
        base = family.predict(family.load_denoiser(flux_model, torch.float32).eval(), noisy, t, cond, torch.float32)
        assert (expected - base).abs().max() > 1e-3  # the LoRA changed something
        for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"):
            pipe = FluxPipeline.from_pretrained(flux_model)
            pipe.load_lora_weights(out, weight_name=name)
            got = family.predict(pipe.transformer.eval(), noisy, t, cond, torch.float32)
            assert (got - expected).abs().max() < 1e-5, name


def test_flux_refuses_image_sides_that_are_not_multiples_of_16_before_encoding(tmp_path, flux_model, run_stages):
    with pytest.raises(UserError) as err:
        run_stages(flux_config(tmp_path, flux_model, resolution=72), STAGES[:2])
    message = str(err.value)
    assert "\n" not in message and "preprocess.resolution" in message and "multiples of 16 px" in message
    assert not list((tmp_path / "cache").glob("samples/*.tar"))  # nothing was encoded
