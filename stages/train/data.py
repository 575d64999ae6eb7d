"""What each training step consumes, and its preparation ahead of the step.

A micro-batch m is fully determined by (seed, m, rank): `BatchPlan` says which samples it holds
and a generator seeded from (seed, m, rank) draws all of its data randomness (plain or mirrored
latent, posterior sample, caption dropout, noise, timesteps). So micro-batches can be prepared in
any order, in background threads, and resuming from a checkpoint stays exact.

`MicroBatches` prepares them `workers` threads ahead of the step (reading records, sampling,
noising, pinning on CUDA), leaving only the copy to the device, the UNet and the optimizer on the
training step's critical path.
"""
from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from stages.encoded import EncodedData, Sample
from stages.train.params import TrainParams


def derived_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class BatchPlan:
    """Which samples micro-batch m gives to each rank (see stages/train/recipe.py's docstring)."""

    def __init__(self, samples: list[Sample], seed: int, batch_size: int, num_processes: int):
        self.seed, self.batch_size, self.global_batch = seed, batch_size, batch_size * num_processes
        buckets: dict[tuple[int, int], list[Sample]] = {}
        for sample in sorted(samples, key=lambda s: s.content_id):  # not by file name: a rename changes nothing
            buckets.setdefault(sample.size, []).extend([sample] * sample.repeats)
        self.buckets = [buckets[size] for size in sorted(buckets)]
        self.batches_per_epoch = sum(len(b) // self.global_batch for b in self.buckets)
        if self.batches_per_epoch == 0:
            sizes = {f"{s[0]}x{s[1]}": len(b) for s, b in sorted(buckets.items())}
            raise ValueError(
                f"no bucket of the train split holds a global batch of {self.global_batch} samples"
                f" (batch_size x num_processes); samples per bucket: {sizes}. Lower batch_size."
            )
        self._epoch: tuple[int, list[list[Sample]]] | None = None
        self._lock = threading.Lock()  # loader threads share the cached epoch

    def epoch(self, epoch: int) -> list[list[Sample]]:
        with self._lock:
            if self._epoch is None or self._epoch[0] != epoch:
                self._epoch = (epoch, self._shuffled(epoch))
            return self._epoch[1]

    def _shuffled(self, epoch: int) -> list[list[Sample]]:
        rng = torch.Generator().manual_seed(derived_seed(self.seed, "epoch", epoch))
        batches = []
        for bucket in self.buckets:
            order = torch.randperm(len(bucket), generator=rng).tolist()
            usable = len(bucket) // self.global_batch * self.global_batch
            batches += [[bucket[i] for i in order[j : j + self.global_batch]] for j in range(0, usable, self.global_batch)]
        return [batches[i] for i in torch.randperm(len(batches), generator=rng).tolist()]

    def batch(self, micro_batch: int, rank: int) -> list[Sample]:
        epoch, index = divmod(micro_batch, self.batches_per_epoch)
        return self.epoch(epoch)[index][rank * self.batch_size : (rank + 1) * self.batch_size]


@dataclass
class Batch:
    latents: torch.Tensor  # (B, C, h, w), scaled by the VAE's scaling factor
    hidden_states: torch.Tensor  # (B, T, D)
    added_cond: dict[str, torch.Tensor] | None  # SDXL: pooled text embeds and size/crop time ids


def draws_flipped(sample: Sample, rng: torch.Generator) -> bool:
    """A sample encoded with a mirrored latent shows it on half of its draws (no draw otherwise,
    so data without flips keeps its random stream)."""
    return sample.latent_flip is not None and torch.rand((), generator=rng).item() < 0.5


def sdxl_time_ids(sample: Sample, flipped: bool) -> list[int]:
    """SDXL's size conditioning: original size, crop top-left (mirrored with the latent), target size."""
    left, top = sample.crop_box[0], sample.crop_box[1]
    if flipped and sample.resized is not None:
        left = sample.resized[1] - sample.crop_box[2]
    return [*sample.original_size, top, left, *sample.size]


def load_batch(data: EncodedData, samples: list[Sample], rng: torch.Generator, caption_dropout: float) -> Batch:
    """Pick plain or mirrored latents, sample each posterior, drop captions (to the cached empty
    prompt) with probability caption_dropout."""
    scale = float(data.index["vae_scaling_factor"])
    empty = data.empty_text()
    latents, texts, time_ids = [], [], []
    for sample in samples:
        flipped = draws_flipped(sample, rng)
        time_ids.append(sdxl_time_ids(sample, flipped))
        mean, std = (t.float() for t in data.latent(sample, flipped))
        latents.append((mean + std * torch.randn(mean.shape, generator=rng)) * scale)
        dropped = torch.rand((), generator=rng).item() < caption_dropout
        texts.append(empty if dropped else data.text(sample))
    added_cond = None
    if data.family == "sdxl":
        added_cond = {
            "text_embeds": torch.stack([t["pooled"].float() for t in texts]),
            "time_ids": torch.tensor(time_ids, dtype=torch.float32),
        }
    hidden = torch.stack([t["hidden_states"].float() for t in texts])
    return Batch(torch.stack(latents), hidden, added_cond)


@dataclass
class UNetInputs:
    """One micro-batch as the UNet step takes it; everything but the UNet is already computed."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    hidden_states: torch.Tensor
    added_cond: dict[str, torch.Tensor] | None
    target: torch.Tensor
    loss_weight: torch.Tensor | None  # min-SNR weight per sample

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "UNetInputs":
        """`fn` applied to every tensor (those of added_cond too)."""
        def apply(value):
            if isinstance(value, dict):
                return {k: fn(t) for k, t in value.items()}
            return None if value is None else fn(value)

        return replace(self, **{f.name: apply(getattr(self, f.name)) for f in fields(self)})


def compute_snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    alpha_bar = alphas_cumprod[timesteps].float()
    return alpha_bar / (1 - alpha_bar)


def noised_inputs(scheduler, batch: Batch, rng: torch.Generator, params: TrainParams) -> UNetInputs:
    """Noise the latents at random timesteps (on the CPU); the target and min-SNR weight to score
    the UNet's prediction against."""
    latents = batch.latents
    noise = torch.randn(latents.shape, generator=rng)
    if params.noise_offset:
        noise += params.noise_offset * torch.randn((*latents.shape[:2], 1, 1), generator=rng)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), generator=rng)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    prediction_type = scheduler.config.prediction_type
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:  # sample: the clean latent, as evaluate scores it
        target = latents
    weight = None
    if params.snr_gamma is not None:  # min-SNR: min(snr, gamma) for the clean latent, / snr for epsilon, / (snr + 1) for v
        snr = compute_snr(scheduler.alphas_cumprod, timesteps)
        weight = torch.clamp(snr, max=params.snr_gamma)
        if prediction_type != "sample":
            weight = weight / (snr if prediction_type == "epsilon" else snr + 1)
    return UNetInputs(noisy, timesteps, batch.hidden_states, batch.added_cond, target, weight)


def prepare_micro_batch(data: EncodedData, plan: BatchPlan, scheduler, params: TrainParams, micro_batch: int,
                        rank: int) -> UNetInputs:
    """Micro-batch m of `rank`, from the generator seeded by (seed, m, rank) alone."""
    rng = torch.Generator().manual_seed(derived_seed(params.seed, "batch", micro_batch, rank))
    batch = load_batch(data, plan.batch(micro_batch, rank), rng, params.caption_dropout)
    return noised_inputs(scheduler, batch, rng, params)


class MicroBatches:
    """Micro-batches first, first + 1, ... prepared by `workers` threads ahead of the step
    (worker w prepares first + w, first + w + workers, ..., up to two in hand); workers=0 prepares
    each one when it is asked for. `get` must be called in order. A worker's error is raised by `get`."""

    def __init__(self, prepare: Callable[[int], UNetInputs], first: int, end: int, workers: int, pin: bool):
        self.prepare, self.first, self.next = prepare, first, first
        self.pin = pin and workers > 0  # pinning pays off only when a thread does it ahead of the copy
        self.stopping = threading.Event()
        self.queues = [queue.Queue(maxsize=2) for _ in range(workers)]
        self.threads = [threading.Thread(target=self._work, args=(range(first + w, end, workers), q), daemon=True)
                        for w, q in enumerate(self.queues)]
        for thread in self.threads:
            thread.start()

    def _work(self, micro_batches: range, out: queue.Queue) -> None:
        for m in micro_batches:
            try:
                item: UNetInputs | BaseException = self._prepared(m)
            except BaseException as error:  # raised again in the training thread
                item = error
            while not self.stopping.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self.stopping.is_set() or isinstance(item, BaseException):
                return

    def _prepared(self, m: int) -> UNetInputs:
        inputs = self.prepare(m)  # page-locked, the copies to the GPU can overlap the step before
        return inputs.map_tensors(torch.Tensor.pin_memory) if self.pin else inputs

    def get(self, m: int) -> UNetInputs:
        if m != self.next:
            raise RuntimeError(f"micro-batch {m} asked for, {self.next} expected")
        self.next += 1
        if not self.queues:
            return self._prepared(m)
        item = self.queues[(m - self.first) % len(self.queues)].get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()
