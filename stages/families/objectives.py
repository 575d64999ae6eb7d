"""The training objective: noise levels, noisy input, target and loss weight, for train and evaluate.

A family turns the user's `ObjectiveParams` and its model's scheduler config into an `Objective`.
Train draws noise and timesteps from the micro-batch's generator (`draw`); evaluate uses fixed
noise and `fixed_timesteps`; both then call `noised`, the one place a target and a weight are
defined, so the two stages cannot drift apart again (they had: train scored a `sample`-prediction
model against v).

- `DDPMObjective` (SD1.x/2.x, SDXL): integer timesteps uniform in [0, T), the scheduler's
  `add_noise`, target epsilon, v or the clean sample, optional min-SNR weight.
- `FlowMatchingObjective` (Flux.1 and the later transformer families): x_t = (1 - s) x0 + s noise,
  target noise - x0, s = shift(u) with u uniform, logit-normal, sigmoid or SD3's "mode", the shift
  static, resolution-dependent (BFL's base_shift/max_shift over the image sequence length) or
  step- and resolution-dependent (Flux.2's empirical mu), or a logit-normal schedule whose mean
  follows the pixel count (Ideogram 4's: with u uniform, sigma is logit-normal as its pipeline's
  schedule), the defaults from the scheduler config unless the family says its pipeline samples
  otherwise; weighting as diffusers'
  `compute_loss_weighting_for_sd3`. Sigma is what `noised` returns as the timestep: a family whose
  transformer reads another convention (Z-Image: 1 - sigma) converts in its `predict`.

Both: input perturbation (Ning et al. 2023, as diffusers' train_text_to_image applies it) noises the
input with noise + gamma * randn while the target keeps the plain noise; `Objective.loss` scores a
prediction with the training loss (`LossFunction`: MSE, or the pseudo-Huber losses kohya and
diffusers call huber and smooth_l1), per latent pixel weighted by a mask, per sample by the weight.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from lorapipe.stages.contract import Frozen

if TYPE_CHECKING:
    import torch
    from diffusers import DDPMScheduler

PredictionType = Literal["epsilon", "v_prediction", "sample"]
MAX_REDRAWS = 100  # rounds of drawing again the noise levels outside a denoiser's range


class TimestepSampling(Frozen):
    """How a flow-matching family draws noise levels in training (all keyed)."""

    distribution: Literal["uniform", "logit_normal", "sigmoid", "mode"] = Field(
        "uniform", description="u in (0, 1): uniform; logit_normal: sigmoid(N(logit_mean, logit_std));"
        " sigmoid: sigmoid(sigmoid_scale * N(0, 1)) (kohya's); mode: SD3's mode sampling (mode_scale)")
    logit_mean: float = Field(0.0, description="logit_normal: the mean of the normal whose sigmoid is u")
    logit_std: float = Field(1.0, gt=0, description="logit_normal: the standard deviation of that normal")
    sigmoid_scale: float = Field(1.0, gt=0, description="sigmoid: the scale of the normal whose sigmoid is u")
    mode_scale: float = Field(1.29, description="mode: the scale s of SD3's mode sampling (0: uniform)")
    shift: Literal["model", "none", "static", "resolution", "empirical", "logit_normal"] = Field(
        "model", description="s = shift(u): static s*u/(1+(s-1)u); resolution: BFL's exp(mu) time shift, mu"
        " linear in the image's token count (a clip's: every frame's) from base_shift to max_shift; empirical: the same time shift at"
        " Flux.2's empirical mu of the token count and shift_steps; logit_normal: sigmoid(m + shift_std * Phi^-1(u)),"
        " m = shift_mean + ln(sqrt(pixels) / 512), its logit clamped to half the pipeline's log-SNR range"
        " (Ideogram 4's schedule: with u uniform, sigma is logit-normal); model: as the model's pipeline samples")
    shift_value: float | None = Field(None, gt=0, description="static: the shift s; null: the scheduler config's"
                                      " `shift`")
    base_shift: float | None = Field(None, description="resolution: mu at 256 image tokens; null: the scheduler"
                                     " config's")
    max_shift: float | None = Field(None, description="resolution: mu at 4096 image tokens; null: the scheduler"
                                    " config's")
    shift_steps: int | None = Field(None, gt=0, description="empirical: the inference steps mu is computed for;"
                                    " null: the model's render steps")
    # unset, they stay out of the train key (runs made before them keep theirs)
    shift_mean: float | None = Field(None, exclude_if=lambda v: v is None, description="logit_normal: the"
                                     " normal's mean at 512x512 pixels; null: the model pipeline's")
    shift_std: float | None = Field(None, gt=0, exclude_if=lambda v: v is None, description="logit_normal: the"
                                    " normal's standard deviation; null: the model pipeline's")


class ObjectiveParams(Frozen):
    """The user's objective settings (train section). A family refuses, naming the key, those that
    do not apply to it; the field names are TrainParams' own where they existed before."""

    prediction_type: PredictionType | None = Field(None, description="SD families: what the model predicts and"
                                                   " is trained against; null: the scheduler config's")
    snr_gamma: float | None = Field(None, gt=0, description="SD families: min-SNR loss weighting with this gamma"
                                    " (5 is usual); null: unweighted")
    noise_offset: float = Field(0.0, ge=0, description="adds this times one Gaussian value per sample and channel"
                                " to the training noise (helps very dark or bright images); 0: off")
    timestep_sampling: TimestepSampling = Field(TimestepSampling(), description="flow-matching families: how"
                                                " training draws noise levels; defaults from the model's"
                                                " scheduler config")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = Field(
        "none", description="flow-matching families: diffusers' compute_loss_weighting_for_sd3")
    guidance: float = Field(1.0, ge=0, description="guidance-distilled models (Flux.1 dev): the guidance"
                            " embedding's input in training")
    # the loss settings at their defaults stay out of the train key (LoRAs made before them stay hits)
    loss_type: Literal["mse", "huber", "smooth_l1"] = Field(
        "mse", exclude_if=lambda v: v == "mse", description="the training loss per latent element, d = prediction - target: mse d^2;"
        " huber 2c(sqrt(d^2 + c^2) - c); smooth_l1 2(sqrt(d^2 + c^2) - c), c = huber_c (kohya's and diffusers')")
    huber_c: float = Field(0.1, gt=0, exclude_if=lambda v: v == 0.1, description="the pseudo-Huber losses' c: quadratic below it, linear above")
    debiased_estimation: bool = Field(
        False, exclude_if=lambda v: not v, description="DDPM epsilon/v models: weight each sample by 1/sqrt(snr) (epsilon) or 1/(snr + 1)"
        " (v), snr capped at 1000 (kohya's debiased estimation); multiplies a min-SNR weight")
    input_perturbation: float = Field(0.0, ge=0, exclude_if=lambda v: v == 0, description="gamma: the noisy input is made with noise +"
                                      " gamma * randn, the target with the noise alone (0: off)")

    def refuse(self, not_applicable: dict[str, str]) -> None:
        """Raise for the first field set to other than its default that does not apply: field -> why.
        (By value, not by `model_fields_set`: a config section passes every field.)"""
        for name, why in not_applicable.items():
            if getattr(self, name) != ObjectiveParams.model_fields[name].get_default(call_default_factory=True):
                raise ValueError(f"train.{name}: {why}")

    def objective_only(self) -> ObjectiveParams:
        """These settings as ObjectiveParams (a subclass's other fields dropped)."""
        return ObjectiveParams(**{name: getattr(self, name) for name in ObjectiveParams.model_fields})


@dataclass(frozen=True)
class LossFunction:
    """The training loss per latent element (ObjectiveParams.loss_type, huber_c)."""

    loss_type: str = "mse"
    huber_c: float = 0.1

    @classmethod
    def of(cls, params: ObjectiveParams) -> LossFunction:
        return cls(params.loss_type, params.huber_c)

    def elementwise(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        if self.loss_type == "mse":
            return F.mse_loss(pred, target, reduction="none")
        c = self.huber_c
        pseudo_huber = 2 * (((pred - target) ** 2 + c * c).sqrt() - c)
        return c * pseudo_huber if self.loss_type == "huber" else pseudo_huber

    def per_sample(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) the mean over each sample's elements; a mask (B, 1, h, w) in [0, 1] weights each
        latent pixel (its zeros drop the pixel; the mean is still over every pixel, as kohya's)."""
        error = self.elementwise(pred, target)
        if mask is not None:
            error = error * fitted(mask, error)
        return error.mean(dim=tuple(range(1, error.ndim)))


def fitted(mask: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """A (B, 1, h, w) mask at the error's spatial size (averaged over each cell where the family's
    latent layout is coarser than the latent record: Flux.2's patchified latents) and
    broadcastable to the error's shape (Qwen-Image's 5-D latents)."""
    import torch.nn.functional as F

    if mask.shape[-2:] != error.shape[-2:]:
        mask = F.adaptive_avg_pool2d(mask, error.shape[-2:])
    return mask.view(mask.shape[0], *[1] * (error.ndim - 3), *mask.shape[-2:])


@dataclass(frozen=True)
class Noised:
    """A batch as the objective prepares it; everything but the denoiser's prediction."""

    noisy: torch.Tensor  # x_t, in the latents' layout
    timesteps: torch.Tensor  # (B,) what the denoiser is given: DDPM integer steps, flow-matching sigmas
    target: torch.Tensor  # what the prediction is scored against, in the latents' layout
    weight: torch.Tensor | None  # (B,) per-sample loss weight; None: plain MSE


def draw_noise(shape: tuple[int, ...], rng: torch.Generator, offset: float) -> torch.Tensor:
    """Gaussian noise, plus `offset` times a per-(sample, channel) constant (noise offset)."""
    import torch

    noise = torch.randn(shape, generator=rng)
    if offset:
        noise += offset * torch.randn((*shape[:2], *[1] * (len(shape) - 2)), generator=rng)
    return noise


class Objective(ABC):
    num_train_timesteps: int
    noise_offset: float
    input_perturbation: float
    loss_function: LossFunction

    @property
    @abstractmethod
    def prediction(self) -> str:
        """What the denoiser is trained to predict: epsilon, v_prediction, sample, or flow (noise - x0)."""

    def draw(self, latents: torch.Tensor, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training's random noise, timesteps and input noise (the noise, perturbed when
        input_perturbation is set) for `latents`, drawn from `rng` in a fixed order."""
        import torch

        noise = draw_noise(tuple(latents.shape), rng, self.noise_offset)
        timesteps = self.sample_timesteps(tuple(latents.shape), rng)
        if not self.input_perturbation:  # no draw: the random stream stays as without it
            return noise, timesteps, noise
        return noise, timesteps, noise + self.input_perturbation * torch.randn(noise.shape, generator=rng)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss of `pred` against a Noised target: per sample (mask-weighted per latent
        pixel), then weighted per sample by the Noised weight, averaged over the batch."""
        per_sample = self.loss_function.per_sample(pred, target, mask)
        return per_sample.mean() if weight is None else (per_sample * weight).mean()

    @abstractmethod
    def sample_timesteps(self, shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor: ...

    @abstractmethod
    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
               input_noise: torch.Tensor | None = None) -> Noised:
        """The noisy input (made with `input_noise`, default `noise`), target and weight for clean
        `latents` (the one definition)."""

    @abstractmethod
    def fixed_timesteps(self, steps: list[int]) -> torch.Tensor:
        """Evaluate's fixed noise levels, given as integer steps in [0, num_train_timesteps)."""

    def steps_scored(self, steps: list[int]) -> list[int]:
        """Of evaluate's fixed steps, those at the noise levels the trained denoiser works at."""
        return steps

    def _check_steps(self, steps: list[int]) -> None:
        if max(steps) >= self.num_train_timesteps:
            raise ValueError(f"evaluate.loss_timesteps must be below {self.num_train_timesteps},"
                             " the model's number of training timesteps")


@dataclass(frozen=True, eq=False)
class DDPMObjective(Objective):
    scheduler: DDPMScheduler
    prediction_type: PredictionType
    snr_gamma: float | None
    noise_offset: float
    debiased_estimation: bool = False
    input_perturbation: float = 0.0
    loss_function: LossFunction = LossFunction()

    def __post_init__(self) -> None:
        if self.debiased_estimation and self.prediction_type == "sample":
            raise ValueError("train.debiased_estimation: applies to epsilon and v_prediction models;"
                             " this one is trained to predict the clean sample")

    @classmethod
    def from_params(cls, scheduler: DDPMScheduler, prediction_type: PredictionType,
                    params: ObjectiveParams) -> DDPMObjective:
        return cls(scheduler, prediction_type, params.snr_gamma, params.noise_offset, params.debiased_estimation,
                   params.input_perturbation, LossFunction.of(params))

    @property
    def num_train_timesteps(self) -> int:  # type: ignore[override]
        return self.scheduler.config.num_train_timesteps

    @property
    def prediction(self) -> str:
        return self.prediction_type

    def sample_timesteps(self, shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor:
        import torch

        return torch.randint(0, self.num_train_timesteps, (shape[0],), generator=rng)

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
               input_noise: torch.Tensor | None = None) -> Noised:
        noisy = self.scheduler.add_noise(latents, noise if input_noise is None else input_noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        elif self.prediction_type == "v_prediction":
            target = self.scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = latents
        return Noised(noisy, timesteps, target, self.weight(timesteps))

    def weight(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weight: min-SNR, debiased estimation, their product, or None."""
        import torch

        weight = None
        alpha_bar = self.scheduler.alphas_cumprod[timesteps].float()
        snr = alpha_bar / (1 - alpha_bar)
        if self.snr_gamma is not None:  # min-SNR (Hang et al. 2023) for each prediction type
            weight = torch.clamp(snr, max=self.snr_gamma)  # x0-prediction's weight; epsilon's and v's:
            if self.prediction_type == "epsilon":
                weight = weight / snr
            elif self.prediction_type == "v_prediction":
                weight = weight / (snr + 1)
        if self.debiased_estimation:  # capped: snr is infinite where alpha_bar reaches 1
            capped = torch.clamp(snr, max=1000.0)
            debiased = 1 / (capped + 1) if self.prediction_type == "v_prediction" else capped.rsqrt()
            weight = debiased if weight is None else weight * debiased
        return weight

    def fixed_timesteps(self, steps: list[int]) -> torch.Tensor:
        import torch

        self._check_steps(steps)
        return torch.tensor(steps, dtype=torch.long)


@dataclass(frozen=True)
class FlowMatchingObjective(Objective):
    sampling: TimestepSampling  # its shift resolved: "none", "static" or "resolution", values filled in
    loss_weighting: str
    noise_offset: float
    num_train_timesteps: int
    patch_size: int  # latent pixels per image-token side, for the image sequence length
    token_pixels: int  # image pixels per image-token side, for the pixel count
    base_seq_len: int
    max_seq_len: int
    input_perturbation: float = 0.0
    loss_function: LossFunction = LossFunction()
    sigma_range: tuple[float, float] = (0.0, math.inf)  # low <= sigma < high: one denoiser's of several
    prediction = "flow"  # the velocity noise - x0

    @classmethod
    def from_scheduler_config(cls, config: dict, params: ObjectiveParams, patch_size: int, token_pixels: int,
                              model_shift: TimestepSampling | None = None) -> FlowMatchingObjective:
        """Unset shift settings take the scheduler config's values (FlowMatchEulerDiscreteScheduler's
        defaults where the config has none). `model_shift`: what shift "model" means when the family's
        pipeline samples otherwise than its scheduler config says (Flux.2: empirical, with the
        variant's render steps; Wan: static at its UniPC scheduler's flow_shift; Ideogram 4: its
        logit-normal schedule); its set fields fill the user's unset ones. `token_pixels`: image
        pixels per token side."""
        s, model = params.timestep_sampling, model_shift or TimestepSampling()
        shift = s.shift
        if shift == "model":
            shift = model.shift if model_shift else "resolution" if config.get("use_dynamic_shifting") else "static"
        resolved = s.model_copy(update={
            "shift": shift,
            "shift_value": first_set(s.shift_value, model.shift_value, config.get("shift", 1.0)),
            "base_shift": first_set(s.base_shift, model.base_shift, config.get("base_shift", 0.5)),
            "max_shift": first_set(s.max_shift, model.max_shift, config.get("max_shift", 1.15)),
            **{name: first_set(getattr(s, name), getattr(model, name)) for name in MODEL_SHIFT_ONLY},
        })
        for name, (needed_by, what) in MODEL_SHIFT_ONLY.items():
            if needed_by == shift and getattr(resolved, name) is None:
                raise ValueError(f"train.timestep_sampling.{name}: the {shift} shift needs {what}")
        return cls(resolved, params.loss_weighting, params.noise_offset, config.get("num_train_timesteps", 1000),
                   patch_size, token_pixels, config.get("base_image_seq_len", 256),
                   config.get("max_image_seq_len", 4096), params.input_perturbation, LossFunction.of(params))

    def sample_timesteps(self, shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor:
        """Noise levels from the sampling distribution; inside sigma_range, that distribution
        conditioned on the range (a draw outside it is drawn again, in a fixed order)."""
        seq_len = sequence_length(shape, self.patch_size)
        sigmas = self._draw(shape[0], seq_len, rng)
        for _ in range(MAX_REDRAWS):
            outside = ~self.in_range(sigmas)
            if not outside.any():
                return sigmas
            sigmas[outside] = self._draw(int(outside.sum()), seq_len, rng)
        low, high = self.sigma_range
        raise ValueError(f"train.timestep_sampling: hardly any noise level it draws is in [{low:g}, {high:g}), where"
                         " the trained denoiser works; sample nearer that range")

    def in_range(self, sigmas: torch.Tensor) -> torch.Tensor:
        low, high = self.sigma_range
        return (sigmas >= low) & (sigmas < high)

    def _draw(self, n: int, image_seq_len: int, rng: torch.Generator) -> torch.Tensor:
        from diffusers.training_utils import compute_density_for_timestep_sampling

        s = self.sampling
        if s.distribution == "sigmoid":
            u = compute_density_for_timestep_sampling("logit_normal", n, 0.0, s.sigmoid_scale, generator=rng)
        else:
            u = compute_density_for_timestep_sampling(s.distribution, n, s.logit_mean, s.logit_std,
                                                      s.mode_scale, generator=rng)
        return self.shifted(u, image_seq_len)

    def shifted(self, u: torch.Tensor, image_seq_len: int) -> torch.Tensor:
        """The scheduler's shifts: FlowMatchEulerDiscreteScheduler's static one and its exponential
        time shift at mu = calculate_shift(image_seq_len) (what FluxPipeline samples with) or at
        Flux.2's compute_empirical_mu(image_seq_len, steps) (what Flux2KleinPipeline samples with);
        Ideogram 4's logit-normal schedule (what Ideogram4Pipeline samples with)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        s = self.sampling
        if s.shift == "static":
            return s.shift_value * u / (1 + (s.shift_value - 1) * u)
        if s.shift == "resolution":
            mu = calculate_shift(image_seq_len, self.base_seq_len, self.max_seq_len, s.base_shift, s.max_shift)
            return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        if s.shift == "empirical":
            mu = compute_empirical_mu(image_seq_len, s.shift_steps)
            return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        if s.shift == "logit_normal":
            return logit_normal_schedule(u, image_seq_len * self.token_pixels ** 2, s.shift_mean, s.shift_std)
        return u

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
               input_noise: torch.Tensor | None = None) -> Noised:
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        sigma = timesteps.view(-1, *[1] * (latents.ndim - 1))
        noisy = (1 - sigma) * latents + sigma * (noise if input_noise is None else input_noise)
        weight = None
        if self.loss_weighting != "none":
            weight = compute_loss_weighting_for_sd3(self.loss_weighting, timesteps)
        return Noised(noisy, timesteps, noise - latents, weight)

    def steps_scored(self, steps: list[int]) -> list[int]:
        low, high = self.sigma_range
        return [step for step in steps if low <= step / self.num_train_timesteps < high]

    def fixed_timesteps(self, steps: list[int]) -> torch.Tensor:
        """sigma = step / num_train_timesteps, unshifted: the same noise levels for every model."""
        import torch

        self._check_steps(steps)
        return torch.tensor(steps, dtype=torch.float32) / self.num_train_timesteps


def sequence_length(shape: tuple[int, ...], patch_size: int) -> int:
    """The denoiser's image tokens for latents of `shape` (B, C, [F,] H, W): (H/p)(W/p) patches of
    each frame (a video latent's every frame: LTX-2's shift counts them all)."""
    return math.prod(shape[2:-2]) * (shape[-2] // patch_size) * (shape[-1] // patch_size)


MODEL_SHIFT_ONLY = {  # settings with no scheduler-config default: the shift that needs each, and what it is
    "shift_steps": ("empirical", "the inference steps"),
    "shift_mean": ("logit_normal", "the logit-normal's mean"),
    "shift_std": ("logit_normal", "the logit-normal's standard deviation"),
}


def first_set(*values):
    """The first value that is not None (None if none is)."""
    return next((v for v in values if v is not None), None)


def logit_normal_schedule(u: torch.Tensor, pixels: int, mean: float, std: float) -> torch.Tensor:
    """Ideogram4Pipeline's sigma at quantile u of its schedule: sigmoid(m + std * Phi^-1(u)), m its
    resolution-aware mean for `pixels`, the logit clamped to half the log-SNR range its
    _logit_normal_sigmas keeps (the limits' defaults there)."""
    import inspect

    import torch
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

    limits = inspect.signature(_logit_normal_sigmas).parameters
    logit = _resolution_aware_mu(pixels, 1, mean) + std * torch.special.ndtri(u)  # its m reads the product alone
    return torch.sigmoid(logit.clamp(limits["logsnr_min"].default / 2, limits["logsnr_max"].default / 2))
