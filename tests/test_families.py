"""What every flow-matching family does alike, a row of tests/family_checks.py's FAMILIES each: its
LoRA presets adapt the modules the row names, and its diffusers LoRA file holds a key for every
trained module's A and B and loads through the family's own pipeline's load_lora_weights, as evaluate
prepares it, meaning what was trained.
Each family's own checks are in tests/test_families_<family>.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from family_checks import FAMILIES, assert_means_what_was_trained, fused_change, keys_of, quiet_pipeline

import lorapipe.stages.families as families

# what encode's key reads of each model folder given, then which model libraries that imported
RESOLVED_KEYS = """
import sys
from pathlib import Path
from lorapipe.stages import encode, families
for path in map(Path, sys.argv[1:]):
    encode.resolved_settings(families.for_model(path), path, encode.EncodeParams())
print(sorted(name for name in ("torch", "diffusers", "transformers") if sys.modules.get(name)))
"""


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
    model = tiny_models(row.arch)
    pipe, family = quiet_pipeline(model), families.for_model(model)
    family.prepare_pipeline(pipe, family.sampler, None)  # as evaluate renders (the Hunyuan pipelines get diffusers' loader)
    assert_means_what_was_trained(transformer, targets, fused_change(pipe, "transformer", written[0]))


def test_what_the_keys_read_of_a_model_imports_no_model_code(tiny_models):
    """A rerun whose every stage is cached computes the keys and loads no model (flows/cached_run.py):
    what encode's key reads of a model folder (text settings, latent normalisation) is read
    without torch, diffusers or transformers, which take seconds to import, for every family."""
    models = [str(tiny_models(arch)) for arch in ("sd15", *(row.arch for row in FAMILIES))]
    loaded = subprocess.run([sys.executable, "-c", RESOLVED_KEYS, *models], capture_output=True, text=True, check=True)
    assert loaded.stdout.splitlines()[-1] == "[]", loaded.stdout
