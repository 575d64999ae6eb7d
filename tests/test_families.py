"""What every flow-matching family does alike, a row of tests/family_checks.py's FAMILIES each: its
LoRA presets adapt the modules the row names, and its diffusers LoRA file holds a key for every
trained module's A and B and loads through the family's own pipeline, meaning what was trained.
Each family's own checks are in tests/test_families_<family>.py."""
from __future__ import annotations

import pytest
import torch
from family_checks import FAMILIES, assert_means_what_was_trained, fused_change, keys_of, quiet_pipeline

import lorapipe.stages.families as families


@pytest.mark.parametrize("row", FAMILIES, ids=str)
def test_lora_presets(row, tiny_models):
    """Each preset is the sorted names of the one before and the modules the row adds for it."""
    model = tiny_models(row.arch)
    family = families.for_model(model)
    denoiser = family.load_denoiser(model, torch.float32)
    attention = family.lora_target_modules(denoiser, "attention")
    assert attention == sorted(row.attention)
    with_ff = family.lora_target_modules(denoiser, "attention_ff")
    assert with_ff == sorted(row.attention | row.feed_forward)
    assert family.lora_target_modules(denoiser, "all_linear") == sorted(set(with_ff) | row.modulation)


@pytest.mark.parametrize("row", FAMILIES, ids=str)
def test_diffusers_export_loads_and_means_what_was_trained(row, tiny_models, exported_loras):
    transformer, targets, written = exported_loras(row.arch, row.lora_targets)
    assert [p.name for p in written] == list(row.exports)
    assert keys_of(written[0]) == {f"transformer.{t}.lora_{ab}.weight" for t in targets for ab in "AB"}
    pipe = quiet_pipeline(tiny_models(row.arch))
    assert_means_what_was_trained(transformer, targets, fused_change(pipe, "transformer", written[0]))
