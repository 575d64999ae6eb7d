"""A model made of a base folder and a converted component file trains as the folder does: a
BFL-layout Flux.1 transformer (the size-free path) and an A1111 SD1.5 checkpoint's UNet train to
the LoRA bytes of the folder they were written from; an fp8 and a ComfyUI scaled-fp8 transformer,
in diffusers' names or BFL's under ComfyUI's prefix, convert to their dequantised weights exactly
(scale applied as ComfyUI applies it) and train with `train.base_quantization: fp8`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from parallel import trained_ahead

from lorapipe.stages import families, train
from lorapipe.stages.families.flux1 import bfl_transformer as size_free
from lorapipe.stages.sources.convert import convert_component

from . import COMFYUI_PREFIX, assert_same_tensors, folder_tensors, write_file
from .sd import write_ldm_checkpoint
from .test_flux import bfl_transformer

PARAMS = dict(rank=2, alpha=2.0, target_modules="attention", learning_rate=1e-3, batch_size=2, max_steps=2,
              checkpoint_every=2, keep_checkpoints=1, seed=3)
LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def ahead():
    with trained_ahead() as placement:
        yield placement


def with_component(base: Path, component: str, file: Path, out: Path, family) -> Path:
    """A model folder: `base` with `component` converted from `file`."""
    shutil.copytree(base, out, ignore=lambda d, names: [component] if Path(d) == base else [])
    convert_component(family, component, file, base, out / component, log=print)
    return out


def trained(model: Path, encoded, out: Path, placement, **overrides) -> Path:
    out.mkdir()
    inputs = train.TrainInputs(encoded_dir=encoded.artifact_dir, cache_root=encoded.cache_root, model_path=model,
                               base_model_digest="base", encoded_digest=encoded.digest)
    params = train.TrainParams(**{**PARAMS, **overrides})
    train.run(params, inputs, out, out.with_name(out.name + "-work"), train.TrainOptions(), log=print,
              placement=placement)
    return out / LORA


def test_converted_files_train_to_the_lora_bytes_of_their_folder(tmp_path, flux_model, flux_encoded, tiny_model,
                                                                  encoded, ahead):
    bfl = write_file(bfl_transformer(flux_model), tmp_path / "flux1-dev.safetensors", "model.diffusion_model.")
    flux = with_component(flux_model, "transformer", bfl, tmp_path / "flux", families.get("flux1"))
    a1111 = write_ldm_checkpoint(tiny_model, tmp_path / "sd15.safetensors", families.get("sd15"))
    sd = with_component(tiny_model, "unet", a1111, tmp_path / "sd", families.get("sd15"))
    for folder, converted, data in ((flux_model, flux, flux_encoded), (tiny_model, sd, encoded)):
        theirs = trained(folder, data, tmp_path / f"{converted.name}-folder", ahead)
        assert trained(converted, data, tmp_path / f"{converted.name}-file", ahead).read_bytes() == theirs.read_bytes()


def fp8_files(tensors: dict[str, torch.Tensor], out: Path, prefix: str = "") -> tuple[Path, Path, dict, dict]:
    """The matrices of `tensors` in fp8 (plain, and ComfyUI's scaled: a per-layer scale_weight and
    the scaled_fp8 marker) as two files under `prefix`, each with the dequantised tensors it holds."""
    fp8 = torch.float8_e4m3fn
    matrices = {k for k, v in tensors.items() if v.ndim == 2}
    plain = {k: v.to(fp8) if k in matrices else v for k, v in tensors.items()}
    scales = {k: v.abs().max().float() / torch.finfo(fp8).max for k, v in tensors.items() if k in matrices}
    scaled = {k: (v / scales[k]).to(fp8) if k in matrices else v for k, v in tensors.items()}
    scaled_file = {**scaled, **{k.removesuffix(".weight") + ".scale_weight": s for k, s in scales.items()},
                   "scaled_fp8": torch.empty(0, dtype=fp8)}
    out.mkdir()
    files = (write_file(plain, out / "fp8.safetensors", prefix),
             write_file(scaled_file, out / "scaled.safetensors", prefix))
    as_comfyui = lambda q, k: q.to(torch.float32) * scales[k].to(torch.float32)  # noqa: E731  weight.to(dtype) * scale
    return (*files, {k: v.float() for k, v in plain.items()},
            {k: as_comfyui(v, k) if k in matrices else v for k, v in scaled.items()})


def test_fp8_and_scaled_fp8_files_convert_to_their_dequantised_weights_and_train_quantised(
        tmp_path, flux_model, flux_encoded, ahead, capsys):
    plain, scaled, plain_expected, scaled_expected = fp8_files(folder_tensors(flux_model, "transformer"),
                                                               tmp_path / "diffusers")
    flux1 = families.get("flux1")
    models = {}
    for file, expected in ((plain, plain_expected), (scaled, scaled_expected)):
        models[file] = with_component(flux_model, "transformer", file, tmp_path / file.stem, flux1)
        assert_same_tensors(folder_tensors(models[file], "transformer"), expected)
    _, bfl_scaled, _, bfl_expected = fp8_files(bfl_transformer(flux_model), tmp_path / "bfl", COMFYUI_PREFIX)
    config = json.loads((flux_model / "transformer" / "config.json").read_text())
    from_bfl = with_component(flux_model, "transformer", bfl_scaled, tmp_path / "bfl-model", flux1)
    assert_same_tensors(folder_tensors(from_bfl, "transformer"), size_free(bfl_expected, config))
    said = capsys.readouterr().out
    assert said.count("fp8 tensors dequantised to float32 for training") == 3
    lora = trained(models[scaled], flux_encoded, tmp_path / "fp8-trained", ahead, base_quantization="fp8")
    assert lora.stat().st_size > 0
