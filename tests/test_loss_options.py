"""Loss options of the objective (train.loss_type/huber_c, debiased_estimation, input_perturbation)
on fixed batches, against values worked out by hand; and what each family refuses.
(tests/test_golden.py pins the defaults: none of these changes a default run.)"""
from __future__ import annotations

import math

import pytest
import torch

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TimestepSampling
from lorapipe.stages.train.params import TrainParams

# d = prediction - target per element, in one sample of 4 elements; per element, with c = 0.1:
#   mse d^2:                          0, 0.01, 1, 9
#   smooth_l1 2 (sqrt(d^2 + c^2) - c): 0, 2(sqrt(0.02) - 0.1), 2(sqrt(1.01) - 0.1), 2(sqrt(9.01) - 0.1)
#                                  = 0, 0.0828427125, 1.8099751242, 5.8033324006
#   huber = c x smooth_l1
DIFF = torch.tensor([0.0, 0.1, 1.0, -3.0]).view(1, 1, 2, 2)
BY_HAND = {"mse": 10.01 / 4, "smooth_l1": 7.6961502373 / 4, "huber": 0.76961502373 / 4}


@pytest.fixture(scope="module")
def sd_objective(tiny_model):
    return lambda **settings: families.for_model(tiny_model).objective(tiny_model, ObjectiveParams(**settings))


@pytest.mark.parametrize("loss_type", ["mse", "huber", "smooth_l1"])
def test_loss_types_by_hand(loss_type, sd_objective):
    objective = sd_objective(loss_type=loss_type)
    target = torch.full((1, 1, 2, 2), 0.5)
    assert objective.loss(target + DIFF, target, None).item() == pytest.approx(BY_HAND[loss_type], rel=1e-6)
    # per-sample weights scale each sample's mean before the batch mean
    pair = torch.cat([target + DIFF, target]), torch.cat([target, target])
    assert objective.loss(*pair, torch.tensor([2.0, 7.0])).item() == pytest.approx(BY_HAND[loss_type], rel=1e-6)


def test_huber_c_moves_the_bend(sd_objective):
    """c = 1: 2 (sqrt(d^2 + 1) - 1) for d = 0, 0.1, 1, -3, times c = 1."""
    expected = 2 * (0 + (math.sqrt(1.01) - 1) + (math.sqrt(2) - 1) + (math.sqrt(10) - 1)) / 4
    objective = sd_objective(loss_type="huber", huber_c=1.0)
    assert objective.loss(DIFF, torch.zeros_like(DIFF), None).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_debiased_estimation_weights(prediction, sd_objective):
    """The tiny model's DDPM schedule is SD's (scaled_linear 0.00085 .. 0.012): at t = 0,
    alpha_bar = 1 - 0.00085, so snr = 0.99915 / 0.00085 = 1175.47, capped at 1000."""
    objective = sd_objective(prediction_type=prediction, debiased_estimation=True)
    t = torch.tensor([0, 999])
    weight = objective.noised(torch.zeros(2, 4, 2, 2), torch.ones(2, 4, 2, 2), t).weight
    alpha_bar_999 = objective.scheduler.alphas_cumprod[999].item()
    snr_999 = alpha_bar_999 / (1 - alpha_bar_999)
    if prediction == "epsilon":
        expected = [1000 ** -0.5, snr_999 ** -0.5]
    else:
        expected = [1 / 1001, 1 / (snr_999 + 1)]
    assert weight.tolist() == pytest.approx(expected, rel=1e-5)
    with_min_snr = sd_objective(prediction_type=prediction, debiased_estimation=True, snr_gamma=5.0)
    min_snr = sd_objective(prediction_type=prediction, snr_gamma=5.0)
    both = with_min_snr.noised(torch.zeros(2, 4, 2, 2), torch.ones(2, 4, 2, 2), t).weight
    alone = min_snr.noised(torch.zeros(2, 4, 2, 2), torch.ones(2, 4, 2, 2), t).weight
    assert torch.allclose(both, alone * weight)  # min-SNR and debiased multiply, as kohya applies both


def test_input_perturbation_noises_the_input_not_the_target(sd_objective, flux_model):
    """The draw keeps its noise and timesteps (the same stream as without perturbation) and adds
    gamma times the next normal draw to the input's noise; the target keeps the plain noise."""
    latents = torch.zeros(2, 4, 2, 2)
    plain, perturbed = sd_objective(), sd_objective(input_perturbation=0.5)
    noise, t, input_noise = plain.draw(latents, torch.Generator().manual_seed(3))
    assert input_noise is noise
    rng = torch.Generator().manual_seed(3)
    p_noise, p_t, p_input = perturbed.draw(latents, rng)
    assert torch.equal(p_noise, noise) and torch.equal(p_t, t)
    replay = torch.Generator().manual_seed(3)
    torch.randn(latents.shape, generator=replay), torch.randint(0, 1000, (2,), generator=replay)
    assert torch.equal(p_input, noise + 0.5 * torch.randn(latents.shape, generator=replay))
    noised = perturbed.noised(latents, p_noise, p_t, p_input)
    assert torch.equal(noised.target, noise)
    assert torch.equal(noised.noisy, perturbed.scheduler.add_noise(latents, p_input, t))
    # flow matching, by hand: x0 = 0, noise = 1, input noise = 3, sigma = 0.5 -> input 1.5, target 1
    flux = families.for_model(flux_model).objective(flux_model, ObjectiveParams(input_perturbation=0.5))
    noised = flux.noised(torch.zeros(1, 16, 2, 2), torch.ones(1, 16, 2, 2), torch.tensor([0.5]),
                         torch.full((1, 16, 2, 2), 3.0))
    assert bool((noised.noisy == 1.5).all()) and bool((noised.target == 1.0).all())


def test_what_a_family_refuses(sd_objective, flux_model):
    flux = families.for_model(flux_model)
    with pytest.raises(ValueError, match="train.debiased_estimation: applies to DDPM models"):
        flux.objective(flux_model, ObjectiveParams(debiased_estimation=True))
    with pytest.raises(ValueError, match="train.debiased_estimation: applies to epsilon and v_prediction"):
        sd_objective(prediction_type="sample", debiased_estimation=True)
    for setting in ({"loss_type": "huber"}, {"input_perturbation": 0.1},
                    {"timestep_sampling": TimestepSampling(distribution="logit_normal")}):
        flux.objective(flux_model, ObjectiveParams(**setting))  # these apply to flow matching


def test_loss_settings_are_train_settings():
    """TrainParams carries them (so they are in the train key) and refuses bad values by key."""
    from pydantic import ValidationError

    params = TrainParams(loss_type="smooth_l1", huber_c=0.3, debiased_estimation=True, input_perturbation=0.1)
    assert params.objective_only().model_dump() == {**ObjectiveParams().model_dump(), "loss_type": "smooth_l1",
                                                    "huber_c": 0.3, "debiased_estimation": True,
                                                    "input_perturbation": 0.1}
    for bad in ({"loss_type": "l1"}, {"huber_c": 0}, {"input_perturbation": -1}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            TrainParams(**bad)
