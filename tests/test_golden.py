"""Golden numbers: what training and evaluation compute on the tiny models, recorded once and
compared against, so that moving the numerical code (the family layer) changes no result.

Each variant runs the real stages on the demo photos at 64 px (preprocess, encode, one training
step, evaluate) through `run_stages`, the config-level entry that survives any refactoring below
it, and checks:
- the training loss of step 1: micro-batch 0 of the batch plan (its samples, posterior draws,
  caption dropout, noise and timesteps all fixed by train.seed), scored before the first update,
  so by the base model (the LoRA starts at zero);
- the held-out denoising loss evaluate reports, base and LoRA (fixed timesteps, noise seeded by
  loss_seed and each sample's content);
- the first rendered image (base model, first prompt, first seed): its pixels against the image
  recorded in tests/golden/<variant>.png, each within 2 levels of 255. The last bits of torch's CPU
  kernels depend on the instruction set they pick (AVX2, AVX-512), which moves a pixel of these
  renders by one level (measured with ATEN_CPU_CAPABILITY=avx2 against avx512 on one machine);
  the checksums below say which pixels each PNG holds.

The numbers are literal, recorded from the code of commit 62e6f5e (main before the stages used the
family layer), except `sample` prediction's, recorded after the fix that made train score it
against the clean latent as evaluate does (train used to score every non-epsilon model against v,
so its step-1 loss was about twice evaluate's on the same model).
Do not recompute them with the code under test: a change here needs a reason in its commit.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import yaml
from parallel import trained_ahead
from PIL import Image

from lorapipe.flows.steps import STAGES
from lorapipe.stages.evaluate.render import cell

DEMO_IMAGES = Path(__file__).resolve().parent.parent / "stages" / "assets" / "demo_images"
GOLDEN_IMAGES = Path(__file__).resolve().parent / "golden"
PIXEL_LEVELS = 2  # how far a pixel may be from the recorded one (instruction-set rounding: 1 seen)
RESOLUTION = 64


@pytest.fixture(scope="module")
def run_stages(run_stages):
    """conftest's run_stages with every variant's training in one process started ahead (parallel.py),
    which trains as a process of its own would: the module's trainings import torch and diffusers once."""
    with trained_ahead() as placement:
        yield partial(run_stages, placements={"train": placement})


@dataclass(frozen=True)
class Variant:
    arch: str  # the tiny model: sd15, sdxl, flux1, flux1-schnell, qwen-image-2.1, flux2-dev, ...
    prediction_type: str | None = None  # written into a copy's scheduler config (SD2-style: v_prediction)
    train: dict = field(default_factory=dict)
    encode: dict = field(default_factory=dict)
    evaluate: dict = field(default_factory=dict)


VARIANTS = {
    "sd15-epsilon": Variant("sd15", train={"caption_dropout": 0.5}),
    "sd2-v-prediction": Variant("sd15", "v_prediction", train={"snr_gamma": 5.0, "noise_offset": 0.05}),
    "sdxl": Variant("sdxl", encode={"flip": True}),  # mirrored latents: flips and mirrored crop ids are drawn
    "sample-prediction": Variant("sd15", "sample", train={"snr_gamma": 5.0}),
}


@dataclass(frozen=True)
class Golden:
    train_loss: float  # step 1
    holdout_base: float
    holdout_lora: float
    first_image: str  # sha256 of tests/golden/<variant>.png's RGB pixels, first 16 hex digits


GOLDEN = {  # recorded from commit 62e6f5e
    "sd15-epsilon": Golden(1.0247102975845337, 1.1235224505265553, 1.122534155845642, "b02cdf0ddbd22293"),
    # its image: 62e6f5e's render on an AVX-512 machine (the one recorded, 0653cfcc5b8109a0, is not kept)
    "sd2-v-prediction": Golden(0.2576902508735657, 0.5291659186283747, 0.5243276841938496, "2afcb0fe011fffd3"),
    "sdxl": Golden(1.0062557458877563, 1.0830445786317189, 1.077387402455012, "012b4fd399f414bd"),
    # recorded after the fix of its training target (commit "Train a sample-prediction model against the
    # clean latent"); before it, step 1 scored the prediction against v: 0.21835727989673615
    "sample-prediction": Golden(0.10691187530755997, 0.0992026353875796, 0.09585366398096085, "b75d5bb60e7ad038"),
}


def pixel_checksum(image: Image.Image) -> str:
    return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()[:16]


def variant_model(variant: Variant, tiny_model: Path, sdxl_model: Path, folder: Path) -> Path:
    base = sdxl_model if variant.arch == "sdxl" else tiny_model
    if variant.prediction_type is None:
        return base
    model = folder / "model"
    shutil.copytree(base, model)
    scheduler = model / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "prediction_type": variant.prediction_type}))
    return model


def write_config(folder: Path, model: Path, variant: Variant, data: Path = DEMO_IMAGES, frames: int | None = None) -> Path:
    """The golden run's config: the demo photos, or with `frames` the clips in `data` as windows of that many."""
    video = {"video": {"fps": 16, "num_frames": frames}} if frames else {}
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({
        "name": "golden", "cache_dir": "cache", "output_dir": "out", "model": {"path": str(model)},
        "data": {"path": str(data)},
        "preprocess": {"resolution": RESOLUTION, "holdout_fraction": 0.25, **video},
        "encode": {"num_workers": 0, **variant.encode},
        "train": {"max_steps": 1, "batch_size": 3, "learning_rate": 1e-2, "seed": 5, "checkpoint_every": 1,
                  "log_with": "none", **variant.train},
        "evaluate": {"prompts": ["a photo of a tabby cat looking to the side"], "seeds": [7], "lora_scales": [1.0],
                     "num_inference_steps": 3, "loss_timesteps": [100, 500, 900], "resolution": RESOLUTION,
                     **({"num_frames": frames} if frames else {}), **variant.evaluate},
    }))
    return config


def measure(done: dict) -> tuple[Golden, np.ndarray]:
    train_dir, eval_dir = (Path(done[stage][1].path) for stage in ("train", "evaluate"))
    first = json.loads((train_dir / "logs" / "loss.jsonl").read_text().splitlines()[0])
    holdout = json.loads((eval_dir / "metrics.json").read_text())["loss"]["holdout"]
    with Image.open(eval_dir / "grid.png") as grid:
        image = cell(grid, 0, 0, RESOLUTION).convert("RGB")
    measured = Golden(first["loss"], holdout["base"]["overall"], holdout["lora"]["overall"], pixel_checksum(image))
    return measured, np.asarray(image, dtype=np.int16)


def assert_golden(name: str, measured: tuple[Golden, np.ndarray], golden: Golden) -> None:
    numbers, pixels = measured
    assert numbers.train_loss == pytest.approx(golden.train_loss, rel=1e-5), numbers
    assert numbers.holdout_base == pytest.approx(golden.holdout_base, rel=1e-5), numbers
    assert numbers.holdout_lora == pytest.approx(golden.holdout_lora, rel=1e-5), numbers
    assert_pixels(name, pixels, golden.first_image, numbers)


def assert_image(name: str, image: Image.Image, checksum: str) -> None:
    """IMAGE is tests/golden/NAME.png (whose pixels' checksum is CHECKSUM) within PIXEL_LEVELS."""
    assert_pixels(name, np.asarray(image.convert("RGB"), dtype=np.int16), checksum, name)


def assert_pixels(name: str, pixels: np.ndarray, checksum: str, context: object) -> None:
    with Image.open(GOLDEN_IMAGES / f"{name}.png") as recorded:
        assert pixel_checksum(recorded) == checksum, f"tests/golden/{name}.png is not the recorded image"
        expected = np.asarray(recorded.convert("RGB"), dtype=np.int16)
    off = np.abs(pixels - expected)
    assert off.max() <= PIXEL_LEVELS, (context, f"{(off > PIXEL_LEVELS).sum()} pixel values off by up to {off.max()}")


@pytest.mark.parametrize("name", VARIANTS)
def test_golden_numbers(name, tmp_path, tiny_model, sdxl_model, run_stages):
    variant = VARIANTS[name]
    model = variant_model(variant, tiny_model, sdxl_model, tmp_path)
    assert_golden(name, measure(run_stages(write_config(tmp_path, model, variant), STAGES)), GOLDEN[name])


FLUX_VARIANTS = {  # the flow-matching objective: x_t = (1 - s) x0 + s noise, target noise - x0
    "flux1-dev": Variant("flux1"),  # resolution-dependent shift, guidance input 1.0 in training
    "flux1-schnell": Variant("flux1-schnell", train={"timestep_sampling": {"distribution": "logit_normal"},
                                                     "loss_weighting": "cosmap"}),
}
# Recorded at Flux.1's first run through the stages (commit "Flux.1 end to end"), once
# tests/test_families_flux1.py had checked its text records, normalisation, transformer call and
# objective against FluxPipeline: they pin Flux.1's numbers from then on, as GOLDEN does SD's.
FLUX_GOLDEN = {
    "flux1-dev": Golden(1.5247539281845093, 1.4049115777015686, 1.4010497530301411, "a329b5faa2ee35e0"),
    "flux1-schnell": Golden(1.6704908609390259, 1.3416847983996074, 1.3368789354960124, "d1020a43726eaacf"),
}


@pytest.mark.parametrize("name", FLUX_VARIANTS)
def test_flux_golden_numbers(name, tmp_path, flux_model, flux_schnell_model, run_stages):
    variant = FLUX_VARIANTS[name]
    model = flux_model if variant.arch == "flux1" else flux_schnell_model
    assert_golden(name, measure(run_stages(write_config(tmp_path, model, variant), STAGES)), FLUX_GOLDEN[name])


# Recorded at Qwen-Image 2.1's first run through the stages, once tests/test_families_qwenimage21.py had
# checked its text records, normalisation and transformer call against QwenImage21Pipeline.
QWEN_IMAGE_21_GOLDEN = Golden(1.9728320837020874, 1.4163203438123066, 1.415086805820465, "4a8d2f9bec4f9f83")


def test_qwen_image_21_golden_numbers(tmp_path, qwenimage21_model, run_stages):
    config = write_config(tmp_path, qwenimage21_model, Variant("qwen-image-2.1"))
    assert_golden("qwen-image-2.1", measure(run_stages(config, STAGES)), QWEN_IMAGE_21_GOLDEN)


# Recorded at Krea 2's first run through the stages (commit "Add the Krea 2 family (base and
# distilled) with its tiny model"), once tests/test_families_krea2.py had checked its text records,
# normalisation, transformer call and shift against Krea2Pipeline: they pin its numbers from then on.
KREA2_GOLDEN = Golden(2.296745538711548, 1.3591198921203613, 1.356546441713969, "87645f9883e98c0c")


def test_krea2_golden_numbers(tmp_path, krea2_model, run_stages):
    measured = measure(run_stages(write_config(tmp_path, krea2_model, Variant("krea2")), STAGES))
    assert_golden("krea2", measured, KREA2_GOLDEN)


# Recorded at Ideogram 4's first run through the stages (commit "Add the Ideogram 4 family with its
# tiny model"), once tests/test_families_ideogram4.py had checked its text records, normalisation
# and transformer call against Ideogram4Pipeline: they pin its numbers from then on. Its step-1 loss and
# LoRA holdout recorded again when training took the pipeline's logit-normal schedule (commit "Train
# Ideogram 4 at its pipeline's logit-normal noise levels"); before it, with the scheduler's static
# shift: 2.6110188961029053 and 1.40516597032547.
IDEOGRAM4_GOLDEN = Golden(2.6160852909088135, 1.4251568516095479, 1.4057496388753254, "5dbd85139005dbb0")


def test_ideogram4_golden_numbers(tmp_path, ideogram4_model, run_stages):
    measured = measure(run_stages(write_config(tmp_path, ideogram4_model, Variant("ideogram4")), STAGES))
    assert_golden("ideogram4", measured, IDEOGRAM4_GOLDEN)


# Recorded at Flux.2-dev's first run through the stages (commit "Pin Flux.2-dev's golden numbers"), once
# tests/test_families_flux2_dev.py had checked its text records, normalisation and transformer call
# (guidance included) against Flux2Pipeline: they pin its numbers from then on. Trained at guidance 3.5,
# so that the value reaches the transformer's guidance input.
FLUX2_DEV_GOLDEN = Golden(2.508070707321167, 1.451669732729594, 1.4509828686714172, "08f3a91b038ac834")


def test_flux2_dev_golden_numbers(tmp_path, tiny_models, run_stages):
    config = write_config(tmp_path, tiny_models("flux2-dev"), Variant("flux2-dev", train={"guidance": 3.5}))
    assert_golden("flux2-dev", measure(run_stages(config, STAGES)), FLUX2_DEV_GOLDEN)


# Flux.1 Kontext without references is Flux.1 dev's text-to-image model, and the tiny Kontext holds the
# tiny Flux.1 dev's weights: its losses are flux1-dev's (both measured equal to the last bit). Its image, rendered by
# FluxKontextPipeline at Kontext's guidance (2.5) and output size (max_area), recorded at its first run
# (commit "Pin Flux.1 Kontext's text-to-image golden numbers"), once tests/test_families_flux1_kontext.py
# had checked its transformer call against FluxKontextPipeline's.
KONTEXT_GOLDEN = Golden(FLUX_GOLDEN["flux1-dev"].train_loss, FLUX_GOLDEN["flux1-dev"].holdout_base,
                        FLUX_GOLDEN["flux1-dev"].holdout_lora, "e4b951ad7bb595d1")


def test_flux1_kontext_text_to_image_golden_numbers(tmp_path, flux_kontext_model, run_stages):
    measured = measure(run_stages(write_config(tmp_path, flux_kontext_model, Variant("flux1-kontext")), STAGES))
    assert_golden("flux1-kontext", measured, KONTEXT_GOLDEN)


# Each recorded at the family's first run through the stages (a plain variant, the tiny model from
# `tiny_models`), once its tests/test_families_<family>.py had checked its text records, normalisation
# and transformer call against its diffusers pipeline: they pin its numbers from then on.
FAMILY_GOLDEN = {
    # every text position and ChromaPipeline's mask
    "chroma": Golden(1.7553458213806152, 1.5976020693778992, 1.567533512910207, "9e8d6ff01acb5e38"),
    # rendered through its modular pipeline (Flux3ModularPipeline, its prompt upsampler left out)
    "flux3": Golden(2.4841225147247314, 1.4933860500653584, 1.4933740297953289, "aa0a5aed5df3ddea"),
    "ernie-image": Golden(2.5594756603240967, 1.476486345132192, 1.4738749861717224, "94998a542f067556"),
    # its image rendered at the guider's scale (adaptive projected mix guidance)
    "hunyuanimage2.1": Golden(2.005096197128296, 1.9129582643508911, 1.8928301235040028, "709d65e7ed2a4bda"),
    # Full: UniPC's static flow_shift in training (transformer checked in inference and training mode),
    # its image rendered at evaluate's size with guidance 5
    "hidream-i1": Golden(1.541206955909729, 1.4348503351211548, 1.4252611796061199, "be58d867cbf1069b"),
    # its batch's captions differ in length, so each row runs the transformer alone
    "kandinsky5": Golden(1.630100131034851, 1.5478323896725972, 1.5134324034055073, "52b33c937eab89fd"),
}


@pytest.mark.parametrize("arch", FAMILY_GOLDEN)
def test_family_golden_numbers(arch, tmp_path, tiny_models, run_stages):
    config = write_config(tmp_path, tiny_models(arch), Variant(arch))
    assert_golden(arch, measure(run_stages(config, STAGES)), FAMILY_GOLDEN[arch])


# The video families on the demo clips (stages/demo/clips.py, the same bytes on every machine), one
# window of 9 frames each; the image is the first frame of the first rendered clip. Each recorded at
# the family's first run through the stages here, once its tests/test_families_<family>.py had checked
# its text records, normalisation and transformer call (for image-to-video: the conditioning record
# and its channels) against its diffusers pipeline: they pin its numbers from then on.
VIDEO_FRAMES = 9
VIDEO_GOLDEN = {
    "wan2.1": Golden(2.948509454727173, 1.7512623866399128, 1.7075002392133076, "efc3a86c2ce15ad5"),
    "ltx2": Golden(1.783990502357483, 1.3164358536402385, 1.2723967333634694, "d9c73ff18cbff7d3"),
    "hunyuanvideo1.5": Golden(5.401336669921875, 2.185679296652476, 2.1511257092158, "b3599afad4fd8584"),
    # image-to-video: the window's first frame its conditioning record, renders conditioned on a held-out one
    "hunyuanvideo1.5-i2v": Golden(5.169785022735596, 1.6768140594164531, 1.6684776544570923, "854891029b555d1d"),
    "kandinsky5-video": Golden(1.6389330625534058, 1.4246582786242168, 1.3841825127601624, "eea442f887c24641"),
    "kandinsky5-i2v": Golden(1.6266628503799438, 1.4136979579925537, 1.3650062481562297, "d7e059ea8e44201d"),
    # LTX-2.3's transformer; rendered through its modular pipeline and decoded by its diffusion decoder
    "ltx2.5": Golden(1.7966543436050415, 1.3085544904073079, 1.2393556733926137, "1b6116735aa0fdd3"),
}


RENDERED_LONGER = {"kandinsky5-i2v": {"num_frames": 17}}  # its pipeline renders no fewer (kandinsky5_i2v.py)


@pytest.fixture(scope="module")
def demo_clips(tmp_path_factory) -> Path:
    from lorapipe.stages.demo.clips import write_demo_clips

    return write_demo_clips(tmp_path_factory.mktemp("demo-clips"))[0].parent


# The last frame of the same clip (grid.webp, lossless: its first cell's last frame), which the
# sampler's frames reach only through the temporal layers; recorded from commit 6020d36, the
# numbers above unchanged there.
VIDEO_LAST_FRAME = {
    "wan2.1": "a2c1de1972aaaa0c", "ltx2": "9daa9235aa8fb41b", "hunyuanvideo1.5": "e40ec6c368697265",
    "hunyuanvideo1.5-i2v": "f58a6843643e7734", "kandinsky5-video": "597ceba9d00417a8",
    "kandinsky5-i2v": "4977b6c4f483c807", "ltx2.5": "39ea85e0fd036067",  # ltx2.5: recorded with its numbers
}


def last_frame(done: dict) -> Image.Image:
    """The animated grid's last frame, its first cell (the base model's first clip)."""
    with Image.open(Path(done["evaluate"][1].path) / "grid.webp") as grid:
        grid.seek(grid.n_frames - 1)
        return cell(grid.convert("RGB"), 0, 0, RESOLUTION)


@pytest.mark.parametrize("arch", VIDEO_GOLDEN)
def test_video_family_golden_numbers(arch, tmp_path, tiny_models, demo_clips, run_stages):
    config = write_config(tmp_path, tiny_models(arch), Variant(arch, evaluate=RENDERED_LONGER.get(arch, {})),
                          demo_clips, VIDEO_FRAMES)
    done = run_stages(config, STAGES)
    assert_golden(arch, measure(done), VIDEO_GOLDEN[arch])
    assert_image(f"{arch}-last", last_frame(done), VIDEO_LAST_FRAME[arch])
