"""Loss masks: a sidecar `<name>.mask.png` or the image's alpha channel, placed exactly as its image
(resize, crop, mirror) at latent resolution, cached as its own record; the training loss weighted by
it per latent pixel; and what an edited or added mask reruns, counted by encoder hooks and by the
records the sample store gains."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from lorapipe.cache.object_store import open_sample_store
from lorapipe.flows.steps import STAGES
from lorapipe.stages import families
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.families import ObjectiveParams
from lorapipe.stages.train.data import StepInputs, load_batch
from lorapipe.stages.train.recipe import step_loss
from test_invalidation import ahead, make_config, run_all, statuses  # noqa: F401 (ahead: a module fixture here)


def left_half_white(width: int, height: int, mode: str = "L") -> Image.Image:
    mask = Image.new(mode, (width, height), 0)
    mask.paste(255, (0, 0, width // 2, height))
    return mask


def photo(width: int, height: int, seed: int) -> Image.Image:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="module")
def masked_set(tmp_path_factory, tiny_model):
    """Two datasets at 64 px, each image encoded plain and mirrored: `sidecar` (wide.png 256x128 with
    a left-half-white wide.mask.png, plain.png without a mask, bad.png whose mask has another size)
    and `alpha` (mask: alpha; cut.png 256x128 RGBA, opaque on its left half)."""
    from lorapipe.cache.digest import StatCache
    from lorapipe.cache.store import ArtifactStore, StageKey
    from lorapipe.stages import encode, preprocess
    from lorapipe.stages.models import component_digests

    root = tmp_path_factory.mktemp("masked")
    sidecar, alpha = root / "sidecar", root / "alpha"
    sidecar.mkdir(), alpha.mkdir()
    for folder, name, image in ((sidecar, "wide", photo(256, 128, 0)), (sidecar, "plain", photo(64, 64, 1)),
                                (sidecar, "bad", photo(64, 64, 2))):
        image.save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"a photo called {name}")
    left_half_white(256, 128).save(sidecar / "wide.mask.png")
    left_half_white(32, 32).save(sidecar / "bad.mask.png")
    cut = photo(256, 128, 3).convert("RGBA")
    cut.putalpha(left_half_white(256, 128))
    cut.save(alpha / "cut.png")
    (alpha / "cut.txt").write_text("a cut-out photo")
    store = ArtifactStore(root / "cache")
    sources = (preprocess.DatasetSource(path=sidecar), preprocess.DatasetSource(path=alpha, mask="alpha"))
    with StatCache(root / "stat.sqlite") as stat_cache:
        params = preprocess.PreprocessParams(resolution=64, holdout_fraction=0)
        pre, _ = store.build(StageKey("preprocess", {"p": 1}), lambda out, work: preprocess.run(
            params, preprocess.PreprocessInputs(sources, stat_cache), out, work), {})
        family = families.for_model(tiny_model)
        digests = component_digests(tiny_model, stat_cache, family)
    inputs = encode.EncodeInputs(pre.path, sources, root / "cache", tiny_model, family.name, digests)
    enc, _ = store.build(StageKey("encode", {"pre": pre.digest}), lambda out, work: encode.run(
        encode.EncodeParams(flip=True), inputs, out, work, encode.EncodeOptions(num_workers=0)), {})
    return pre.path, EncodedData(enc.path, root / "cache")


def test_a_mask_is_placed_as_its_image(masked_set):
    """256x128 at 64 px: resized to 128x64, cropped to columns 32..96, so the mask's white left half
    covers the crop's columns 0..32: latent columns 0..3 (8 px each); mirrored, columns 4..7. The
    boundary pixel columns 31/32 may blend in the bicubic resize, so latent columns 3 and 4 are near
    1 and 0; the rest exact. An alpha channel is placed the same way."""
    pre_dir, data = masked_set
    report = json.loads((pre_dir / "report.json").read_text())
    assert [(r["path"], r["reason"]) for r in report["rejected"]] == [("sidecar/bad.png", "bad_mask")]
    assert "is 32x32, the image 64x64" in report["rejected"][0]["detail"]
    samples = {s.id: s for s in data.samples}
    assert sorted(samples) == ["alpha/cut", "sidecar/plain", "sidecar/wide"]  # wide.mask.png is no image
    assert data.mask(samples["sidecar/plain"]) is None
    for sample in (samples["sidecar/wide"], samples["alpha/cut"]):
        for flipped in (False, True):
            mask = data.mask(sample, flipped)
            assert mask.shape == (1, 8, 8) and mask.shape[1:] == data.latent(sample, flipped)[0].shape[1:]
            columns = mask[0].mean(dim=0)
            if flipped:
                columns = columns.flip(0)
            assert columns[:3].tolist() == [1.0] * 3 and columns[5:].tolist() == [0.0] * 3
            assert columns[3] > 0.95 and columns[4] < 0.05
            assert bool((mask == mask[:, :1]).all())  # every row alike


def test_training_batches_carry_the_masks(masked_set):
    """A batch holds each sample's mask of the latent it drew (mirrored with it), ones where the
    sample has none; a batch of unmasked samples has none (the step stays plain)."""
    _, data = masked_set
    samples = {s.id: s for s in data.samples}
    chosen = [samples["sidecar/wide"], samples["sidecar/plain"]]
    batch = load_batch(data, chosen, torch.Generator().manual_seed(0), 0.0)
    flipped = batch.images[0][1]
    assert torch.equal(batch.masks[0], data.mask(chosen[0], flipped)) and bool((batch.masks[1] == 1).all())
    assert load_batch(data, [samples["sidecar/plain"]], torch.Generator().manual_seed(0), 0.0).masks is None


def test_a_zero_mask_region_does_not_reach_the_gradient(tiny_model):
    """The step's loss with a mask whose right half is 0: changing the target there changes neither
    the loss nor any gradient; without the mask it changes both."""
    family = families.for_model(tiny_model)
    objective = family.objective(tiny_model, ObjectiveParams())
    unet = family.load_denoiser(tiny_model, torch.float32)
    rng = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 8, generator=rng)
    conditioning = {"encoder_hidden_states": torch.randn(2, 7, unet.config.cross_attention_dim, generator=rng)}
    target = torch.randn(2, 4, 8, 8, generator=rng)
    other = target.clone()
    other[..., 4:] += 3.0
    mask = torch.ones(2, 1, 8, 8)
    mask[..., 4:] = 0

    def loss_and_grads(target, mask):
        unet.zero_grad()
        inputs = StepInputs(noisy, torch.tensor([10, 500]), conditioning, target, None, mask)
        loss = step_loss(family, objective, unet, inputs, torch.device("cpu"), torch.float32)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in unet.parameters()]

    masked, masked_other = loss_and_grads(target, mask), loss_and_grads(other, mask)
    assert masked[0] == masked_other[0]
    assert all(torch.equal(a, b) for a, b in zip(masked[1], masked_other[1]))
    plain, plain_other = loss_and_grads(target, None), loss_and_grads(other, None)
    assert plain[0] != plain_other[0]
    assert not all(torch.equal(a, b) for a, b in zip(plain[1], plain_other[1]))


# ---- invalidation: what adding or editing a mask reruns

@pytest.fixture(scope="module")
def unmasked_run(tmp_path_factory, tiny_model, demo_images, count_encoder_rows, ahead):
    """The demo photos (no masks) through preprocess, encode and train; tests copy its data. The
    module's trainings run in one process started ahead (`ahead`)."""
    root = tmp_path_factory.mktemp("unmasked")
    shutil.copytree(demo_images, root / "data")
    with count_encoder_rows() as counts:
        run_all(make_config(root, tiny_model, root / "data", root / "cache"), STAGES[:3], placements=ahead)
    assert counts == {"vae": 8, "text": 9}
    return root


def run_counted(config, count_encoder_rows, cache: Path, placements: dict) -> tuple[dict, dict, set[str]]:
    """(results, encoder rows, record keys the sample store gained) of preprocess, encode and train."""
    before = set(open_sample_store(cache).index())
    with count_encoder_rows() as counts:
        results = run_all(config, STAGES[:3], placements=placements)
    return results, counts, set(open_sample_store(cache).index()) - before


def copy_run(unmasked_run: Path, tmp_path: Path, tiny_model: Path):
    """A config over copies of the unmasked run's data and cache (each test adds its own records)."""
    for part in ("data", "cache"):
        shutil.copytree(unmasked_run / part, tmp_path / part)
    return make_config(tmp_path, tiny_model, tmp_path / "data", tmp_path / "cache")


@pytest.mark.slow
def test_adding_a_mask_encodes_one_mask_record_and_keeps_latents_and_texts(unmasked_run, tmp_path, tiny_model,
                                                                           count_encoder_rows, ahead):
    config = copy_run(unmasked_run, tmp_path, tiny_model)
    left_half_white(128, 85).save(tmp_path / "data" / "coffee.mask.png")
    results, counts, new = run_counted(config, count_encoder_rows, tmp_path / "cache", ahead)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed", "train": "computed"}
    assert counts == {"vae": 0, "text": 0} and len(new) == 1
    coffee = next(s for s in EncodedData(Path(results["encode"].path), tmp_path / "cache").samples if s.id == "coffee")
    assert new == {coffee.mask.key}


@pytest.mark.slow
def test_editing_a_mask_re_encodes_that_mask_alone_and_retrains(unmasked_run, tmp_path, tiny_model,
                                                                count_encoder_rows, ahead):
    config = copy_run(unmasked_run, tmp_path, tiny_model)
    left_half_white(128, 85).save(tmp_path / "data" / "coffee.mask.png")
    left_half_white(128, 85).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(tmp_path / "data" / "rocket.mask.png")
    assert len(run_counted(config, count_encoder_rows, tmp_path / "cache", ahead)[2]) == 2  # (equal masks share a record)
    edited = left_half_white(128, 85)
    edited.paste(128, (0, 0, 128, 20))  # a gray band across the top
    edited.save(tmp_path / "data" / "coffee.mask.png")
    results, counts, new = run_counted(config, count_encoder_rows, tmp_path / "cache", ahead)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed", "train": "computed"}
    assert counts == {"vae": 0, "text": 0} and len(new) == 1
    results, counts, new = run_counted(config, count_encoder_rows, tmp_path / "cache", ahead)
    assert statuses(results) == dict.fromkeys(STAGES[:3], "hit") and counts == {"vae": 0, "text": 0} and not new


def test_a_mask_fits_each_family_layout():
    """A latent-resolution mask weights a coarser layout (Flux.2's 2x2-patchified latents) by each
    cell's mean, and a 5-D one (Qwen-Image's frame axis) per pixel: left half 1, right half 0."""
    from lorapipe.stages.families.objectives import LossFunction

    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2] = 1
    patched = LossFunction().per_sample(torch.ones(1, 8, 2, 2), torch.zeros(1, 8, 2, 2), mask)
    assert patched.item() == 0.5  # cells [[1, 0], [1, 0]] of squared error 1
    half = torch.zeros(1, 1, 4, 4)
    half[..., :1] = 1  # a quarter of the columns: cells [[0.5, 0], [0.5, 0]]
    assert LossFunction().per_sample(torch.ones(1, 8, 2, 2), torch.zeros(1, 8, 2, 2), half).item() == 0.25
    two = torch.cat([mask, torch.ones(1, 1, 4, 4)])  # each sample its own mask
    frames = LossFunction().per_sample(torch.ones(2, 16, 1, 4, 4), torch.zeros(2, 16, 1, 4, 4), two)
    assert frames.tolist() == [0.5, 1.0]
