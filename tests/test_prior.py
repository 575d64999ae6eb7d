"""Prior preservation: a dataset with role: prior, train.prior_loss_weight and train.prior_target,
through the real preprocess, encode and train stages on the tiny models. Prior images are trained on
but never held out; each prior sample's loss is weighted by prior_loss_weight (checked by hand on a
fixed batch); with prior_target base_output its target is the base model's own prediction (with a
zero-initialised LoRA B the prior loss and its gradient are exactly 0), for every family; a run with
prior data resumed from its halfway checkpoint publishes the same bytes as a straight one."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import DEMO_IMAGES, _encode_demo_images
from parallel import trained_ahead
from test_train_adapters import published, run_train

from lorapipe.stages import families
from lorapipe.stages.encode import EncodeParams
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.preprocess import DatasetSource
from lorapipe.stages.train import TrainParams
from lorapipe.stages.train.data import load_batch, step_inputs
from lorapipe.stages.train.prior import base_output_target
from lorapipe.stages.train.recipe import step_loss

SUBJECT = ("astronaut", "camera", "chelsea", "coffee")  # the other four demo photos are the prior images
CPU = torch.device("cpu")


def split_demo_images(root: Path) -> tuple[DatasetSource, DatasetSource]:
    """The demo photos as two datasets: the subject's four and four prior images."""
    for image in DEMO_IMAGES.glob("*.jpg"):
        folder = root / ("subject" if image.stem in SUBJECT else "prior")
        folder.mkdir(parents=True, exist_ok=True)
        for file in (image, image.with_suffix(".txt")):
            shutil.copy(file, folder / file.name)
    return DatasetSource(path=root / "subject"), DatasetSource(path=root / "prior", role="prior")


@pytest.fixture(scope="module")
def prior_encoded(tmp_path_factory, tiny_model, encoded, count_encoder_rows):
    root = tmp_path_factory.mktemp("prior")
    shutil.copytree(encoded.cache_root, root / "cache")
    with count_encoder_rows() as counts:
        prior = _encode_demo_images(root / "cache", tiny_model, EncodeParams(), split_demo_images(root / "data"))
    assert counts == {"vae": 0, "text": 0}  # a dataset's role changes no record
    return prior


@pytest.fixture(scope="module")
def flux_prior_encoded(tmp_path_factory, flux_model, flux_encoded):
    root = tmp_path_factory.mktemp("flux-prior")
    shutil.copytree(flux_encoded.cache_root, root / "cache")
    return _encode_demo_images(root / "cache", flux_model, EncodeParams(), split_demo_images(root / "data"))


def test_prior_images_are_trained_on_never_held_out(prior_encoded):
    data = EncodedData(prior_encoded.artifact_dir, prior_encoded.cache_root)
    roles = {s.id: (s.role, s.split) for s in data.samples}
    assert {i.split("/")[1].split(".")[0] for i, (role, _) in roles.items() if role == "prior"} \
        == {p.stem for p in DEMO_IMAGES.glob("*.jpg")} - set(SUBJECT)
    assert all(split == "train" for role, split in roles.values() if role == "prior")
    assert sum(split == "holdout" for _, split in roles.values()) == 1  # 0.25 of the subject's four


def test_a_prior_dataset_cannot_be_held_out():
    with pytest.raises(ValueError, match="split: holdout with role: prior"):
        DatasetSource(path="x", role="prior", split="holdout")


def fixed_batch(data: EncodedData, roles: tuple[str, ...], seed: int = 0):
    """Train samples of the encoded set in `roles`, as the batch plan would give them."""
    samples = sorted(data.split("train"), key=lambda s: s.content_id)
    chosen = [replace(sample, role=role) for sample, role in zip(samples, roles)]
    return load_batch(data, chosen, torch.Generator().manual_seed(seed), 0.0)


@pytest.mark.parametrize("snr_gamma", [None, 5.0])
def test_prior_loss_weight_weights_each_prior_sample(snr_gamma, prior_encoded, tiny_model):
    """By hand on a fixed batch (subject, prior, prior): the loss is the batch mean of each sample's
    MSE times its objective weight (min-SNR) times prior_loss_weight where it is a prior sample."""
    data = EncodedData(prior_encoded.artifact_dir, prior_encoded.cache_root)
    family = families.for_model(tiny_model)
    params = TrainParams(prior_loss_weight=0.25, snr_gamma=snr_gamma)
    objective = family.objective(tiny_model, params)
    batch = fixed_batch(data, ("train", "prior", "prior"))
    assert batch.priors.tolist() == [False, True, True]
    inputs = step_inputs(family, objective, batch, torch.Generator().manual_seed(1), params)
    unet = family.load_denoiser(tiny_model, torch.float32)
    with torch.no_grad():
        loss = step_loss(family, objective, unet, inputs, CPU, torch.float32)
        pred = family.predict(unet, inputs.noisy, inputs.timesteps, inputs.conditioning, torch.float32)
    per_sample = ((pred - inputs.target) ** 2).mean(dim=(1, 2, 3))
    weight = torch.tensor([1.0, 0.25, 0.25])
    if snr_gamma:
        weight = weight * objective.weight(inputs.timesteps)
    assert loss.item() == pytest.approx((per_sample * weight).mean().item(), rel=1e-6)
    unweighted = step_inputs(family, objective, batch, torch.Generator().manual_seed(1), TrainParams(snr_gamma=snr_gamma))
    assert torch.equal(unweighted.target, inputs.target)  # at prior_loss_weight 1 only the weight differs
    assert unweighted.loss_weight is None if snr_gamma is None else \
        torch.allclose(unweighted.loss_weight * torch.tensor([1.0, 0.25, 0.25]), inputs.loss_weight)


def lora_denoiser(family: families.Family, model: Path) -> torch.nn.Module:
    """The family's denoiser with a LoRA as training gives it one (B zero-initialised)."""
    from peft import LoraConfig

    denoiser = family.load_denoiser(model, torch.float32)
    denoiser.requires_grad_(False)
    targets = family.lora_target_modules(denoiser, "attention")
    denoiser.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets))
    return denoiser


@pytest.mark.parametrize("arch", ["sd15", "flux1"])
def test_base_output_target_is_the_base_models_prediction(arch, request, tmp_path):
    """No family branches: the family's predict with the adapter off is the prior samples' target."""
    model = request.getfixturevalue({"sd15": "tiny_model", "flux1": "flux_model"}[arch])
    encoded = request.getfixturevalue({"sd15": "prior_encoded", "flux1": "flux_prior_encoded"}[arch])
    data = EncodedData(encoded.artifact_dir, encoded.cache_root)
    family = families.for_model(model)
    params = TrainParams(prior_target="base_output")
    objective = family.objective(model, params)
    denoiser = lora_denoiser(family, model).train()
    lora = [t for t in denoiser.parameters() if t.requires_grad]
    # all prior, at step 1 (B = 0): the adapted model is its base, so the loss and its gradient are 0
    inputs = step_inputs(family, objective, fixed_batch(data, ("prior", "prior")), torch.Generator().manual_seed(2),
                         params)
    loss = step_loss(family, objective, denoiser, inputs, CPU, torch.float32, base_output_of=denoiser)
    loss.backward()
    assert loss.item() == 0.0 and all(t.grad is not None and not t.grad.any() for t in lora)
    # a trained adapter: the prior rows' target is what the model without the adapter predicts
    with torch.no_grad():
        for name, t in denoiser.named_parameters():
            if "lora_B" in name:
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    mixed = step_inputs(family, objective, fixed_batch(data, ("train", "prior", "prior")),
                        torch.Generator().manual_seed(4), params)
    target = base_output_target(family, denoiser, mixed, torch.float32)
    base = family.load_denoiser(model, torch.float32)
    with torch.no_grad():
        expected = family.predict(base, mixed.noisy, mixed.timesteps, mixed.conditioning, torch.float32)
        adapted = family.predict(denoiser, mixed.noisy, mixed.timesteps, mixed.conditioning, torch.float32)
    assert torch.equal(target[0], mixed.target[0])  # the subject sample keeps its data target
    assert torch.allclose(target[1:], expected[1:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(adapted[1:], expected[1:], atol=1e-3)  # and the adapter is on again,
    assert all(t.requires_grad for t in lora)  # still trainable


def test_a_run_with_prior_data_resumes_exactly(tmp_path, tiny_model, prior_encoded):
    """base_output and a prior weight through the real train stage: a run resumed from the halfway
    checkpoint publishes the same files, byte for byte, as one that ran straight."""
    settings = dict(prior_target="base_output", prior_loss_weight=0.5, ema_decay=None, batch_size=3)
    with trained_ahead() as warm:  # both in one process started ahead, which trains as its own would
        straight = run_train(tmp_path, "straight", tiny_model, prior_encoded, tmp_path / "work-straight", warm,
                             **settings)
        halfway = "checkpoints/step-000002"
        shutil.copytree(tmp_path / "work-straight" / halfway, tmp_path / "work" / halfway)
        resumed = run_train(tmp_path, "resumed", tiny_model, prior_encoded, tmp_path / "work", warm, **settings)
    files = published(straight)
    assert "pytorch_lora_weights.safetensors" in files and published(resumed) == files


def test_prior_settings_need_prior_data(tmp_path, tiny_model, encoded):
    from lorapipe.cache.errors import UserError

    with pytest.raises(UserError, match=r"train.prior_target: no training image comes from a dataset with role: prior"):
        run_train(tmp_path, "none", tiny_model, encoded, tmp_path / "work", prior_target="base_output")


def test_prior_settings_stay_out_of_the_keys_at_their_defaults():
    assert "role" not in DatasetSource(path="x").model_dump()  # the preprocess key as before
    assert DatasetSource(path="x", role="prior").model_dump()["role"] == "prior"
    keyed = TrainParams(prior_loss_weight=0.5, prior_target="base_output").model_dump(mode="json")
    assert keyed["prior_loss_weight"] == 0.5 and keyed["prior_target"] == "base_output"
