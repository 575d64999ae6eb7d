"""What each training step consumes, and its preparation before the step.

A micro-batch m is fully determined by (seed, m, rank): `BatchPlan` says which samples it holds
and a generator seeded from (seed, m, rank) draws all of its data randomness (plain or mirrored
latent, posterior sample, caption dropout, then the objective's noise and timesteps); a sample's
caption variant (encode.caption_variants) is the plan's, from (seed, epoch, sample, its copy). So
micro-batches can be prepared in any order, in background threads, and resuming from a checkpoint
stays exact.

The model-specific parts come from the family (stages/families): the latent normalisation recorded
with the records, the objective (noisy input, target, weight: the one train and evaluate share) and
the conditioning (SDXL's size ids, Flux's pooled text and guidance, a family's padding rule). A
prior sample (a `role: prior` dataset's) has its weight multiplied by train.prior_loss_weight and
is marked in `StepInputs.prior` (train.prior_target base_output replaces its target in the step).

`MicroBatches` prepares them `workers` threads before the step needs them (reading records, sampling,
noising, pinning on CUDA), leaving only the copy to the device, the denoiser and the optimizer on
the training step's critical path.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Callable

import torch

from lorapipe.stages.contract import derived_seed
from lorapipe.stages.encoded import EncodedData, Sample
from lorapipe.stages.train.params import TrainParams

if TYPE_CHECKING:
    from lorapipe.stages.families import Family
    from lorapipe.stages.families.base import ImageGeometry, TextRecord
    from lorapipe.stages.families.objectives import Objective


class BatchPlan:
    """Which samples micro-batch m gives to each rank (see stages/train/recipe.py's docstring)."""

    def __init__(self, samples: list[Sample], seed: int, batch_size: int, num_processes: int):
        self.seed, self.batch_size, self.global_batch = seed, batch_size, batch_size * num_processes
        buckets: dict[tuple[int, ...], list[tuple[Sample, int]]] = {}  # by shape and reference count  # each sample once per repeat (its copy)
        for sample in sorted(samples, key=lambda s: s.content_id):  # not by file name: a rename changes nothing
            buckets.setdefault((*sample.shape, len(sample.references)), []).extend((sample, copy) for copy in range(sample.repeats))
        self.buckets = [buckets[shape] for shape in sorted(buckets)]
        self.batches_per_epoch = sum(len(b) // self.global_batch for b in self.buckets)
        if self.batches_per_epoch == 0:
            sizes = {(f"{f}x" if f else "") + f"{h}x{w}" + (f"+{k} references" if k else ""): len(b)
                     for (f, h, w, k), b in sorted(buckets.items())}
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
            batches += [[self._drawn(*bucket[i], epoch) for i in order[j : j + self.global_batch]]
                        for j in range(0, usable, self.global_batch)]
        return [batches[i] for i in torch.randperm(len(batches), generator=rng).tolist()]

    def _drawn(self, sample: Sample, copy: int, epoch: int) -> Sample:
        """The sample as this draw shows it: with caption variants, its text is the variant drawn.
        A sample's draws (epoch by epoch, copy by copy) go in runs of K, each run showing every one
        of its K variants once, in an order seeded by (seed, sample, run)."""
        variants = sample.text_variants
        if not variants:
            return sample
        run, position = divmod(epoch * sample.repeats + copy, len(variants))
        order = sorted(range(len(variants)),
                       key=lambda v: derived_seed(self.seed, "caption", sample.content_id, run, v))
        return replace(sample, text=variants[order[position]])

    def batch(self, micro_batch: int, rank: int) -> list[Sample]:
        epoch, index = divmod(micro_batch, self.batches_per_epoch)
        return self.epoch(epoch)[index][rank * self.batch_size : (rank + 1) * self.batch_size]


@dataclass
class Batch:
    """A micro-batch's data before the objective: sampled, normalised latents and what conditions them."""

    latents: torch.Tensor  # (B, C, h, w) under the encode artifact's latent normalisation
    texts: list[TextRecord]  # as stored (a dropped caption: the empty prompt's record)
    images: list[tuple[ImageGeometry, bool]]  # each sample and whether its latent is the mirrored one
    masks: torch.Tensor | None = None  # (B, 1, h, w) loss weights at the latent records' size; None: no
    # sample of the batch has a mask (one without gets weight 1)
    priors: torch.Tensor | None = None  # (B,) bool: which samples come from a dataset with role: prior;
    # None: none of the batch's
    references: dict[str, torch.Tensor] | None = None  # the references' conditioning (EncodedData.reference_conditioning,
    # batched): REFERENCE_LATENTS (B, K, C, h, w) of edit pairs (mirrored with their target); None: the batch's
    # samples have none


def draws_flipped(sample: Sample, rng: torch.Generator) -> bool:
    """A sample encoded with a mirrored latent shows it on half of its draws (no draw otherwise,
    so data without flips keeps its random stream)."""
    return sample.latent_flip is not None and torch.rand((), generator=rng).item() < 0.5


def load_batch(data: EncodedData, samples: list[Sample], rng: torch.Generator, caption_dropout: float) -> Batch:
    """Pick plain or mirrored latents, sample each posterior and normalise it, drop captions (to the
    cached empty prompt) with probability caption_dropout; the loss masks of the latents picked."""
    latents, texts, images, masks, references = [], [], [], [], []
    for sample in samples:
        flipped = draws_flipped(sample, rng)
        mean, std = (t.float() for t in data.latent(sample, flipped))
        latents.append(data.normalisation.apply((mean + std * torch.randn(mean.shape, generator=rng)).unsqueeze(0)))
        dropped = torch.rand((), generator=rng).item() < caption_dropout
        texts.append(data.empty_text(sample) if dropped else data.text(sample))
        images.append((sample, flipped))
        masks.append(data.mask(sample, flipped))
        references.append(data.reference_conditioning(sample, flipped))
    priors = [sample.role == "prior" for sample in samples]
    return Batch(torch.cat(latents), texts, images, batch_masks(masks, latents[0].shape[-2:]),
                 torch.tensor(priors) if any(priors) else None,
                 None if references[0] is None else {name: torch.stack([r[name] for r in references])
                                                     for name in references[0]})


def batch_masks(masks: list[torch.Tensor | None], size: torch.Size) -> torch.Tensor | None:
    """The masks stacked (B, 1, h, w), ones for a sample without one; None when none has one."""
    if all(m is None for m in masks):
        return None
    return torch.stack([torch.ones(1, *size) if m is None else m.float() for m in masks])


@dataclass
class StepInputs:
    """One micro-batch as the step takes it; everything but the denoiser's prediction is computed."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    conditioning: dict[str, torch.Tensor]  # the family's denoiser inputs besides x_t and t
    target: torch.Tensor
    loss_weight: torch.Tensor | None  # per sample (min-SNR, flow-matching weighting, prior_loss_weight)
    loss_mask: torch.Tensor | None = None  # per latent pixel (B, 1, h, w): Batch.masks
    prior: torch.Tensor | None = None  # (B,) bool: the prior samples (Batch.priors)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "StepInputs":
        """`fn` applied to every tensor (the conditioning's too)."""
        def apply(value):
            if isinstance(value, dict):
                return {k: fn(t) for k, t in value.items()}
            return None if value is None else fn(value)

        return replace(self, **{f.name: apply(getattr(self, f.name)) for f in fields(self)})

    def rows(self, index: torch.Tensor) -> "StepInputs":
        """The micro-batch's samples at `index` (every tensor is batch-first, the conditioning's too)."""
        return self.map_tensors(lambda t: t[index])


def step_inputs(family: Family, objective: Objective, batch: Batch, rng: torch.Generator,
                params: TrainParams) -> StepInputs:
    """Noise the batch's latents at timesteps drawn from `rng` (on the CPU): the objective's noisy
    input, target and weight, and the family's conditioning."""
    noised = objective.noised(batch.latents, *objective.draw(batch.latents, rng))
    conditioning = family.conditioning(batch.texts, batch.images, params)
    conditioning |= batch.references or {}
    return StepInputs(noised.noisy, noised.timesteps, conditioning,
                      noised.target, prior_weighted(noised.weight, batch.priors, params.prior_loss_weight),
                      batch.masks, batch.priors)


def prior_weighted(weight: torch.Tensor | None, priors: torch.Tensor | None,
                   prior_loss_weight: float) -> torch.Tensor | None:
    """The per-sample loss weight with each prior sample's multiplied by prior_loss_weight (kohya's
    per-sample form of DreamBooth's prior loss); unchanged without prior samples or at weight 1."""
    if priors is None or prior_loss_weight == 1.0:
        return weight
    factor = torch.where(priors, prior_loss_weight, 1.0)
    return factor if weight is None else weight * factor


def prepare_micro_batch(data: EncodedData, plan: BatchPlan, family: Family, objective: Objective, params: TrainParams,
                        micro_batch: int, rank: int) -> StepInputs:
    """Micro-batch m of `rank`, from the generator seeded by (seed, m, rank) alone."""
    rng = torch.Generator().manual_seed(derived_seed(params.seed, "batch", micro_batch, rank))
    batch = load_batch(data, plan.batch(micro_batch, rank), rng, params.caption_dropout)
    return step_inputs(family, objective, batch, rng, params)


class MicroBatches:
    """Micro-batches first, first + 1, ... prepared by `workers` threads before the step needs them
    (worker w prepares first + w, first + w + workers, ..., up to two in hand); workers=0 prepares
    each one when it is asked for. `get` must be called in order. A worker's error is raised by `get`."""

    def __init__(self, prepare: Callable[[int], StepInputs], first: int, end: int, workers: int, pin: bool):
        self.prepare, self.first, self.next = prepare, first, first
        self.pin = pin and workers > 0  # pinning pays off only when a thread does it before the copy
        self.stopping = threading.Event()
        self.queues = [queue.Queue(maxsize=2) for _ in range(workers)]
        self.threads = [threading.Thread(target=self._work, args=(range(first + w, end, workers), q), daemon=True)
                        for w, q in enumerate(self.queues)]
        for thread in self.threads:
            thread.start()

    def _work(self, micro_batches: range, out: queue.Queue) -> None:
        for m in micro_batches:
            try:
                item: StepInputs | BaseException = self._prepared(m)
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

    def _prepared(self, m: int) -> StepInputs:
        inputs = self.prepare(m)  # page-locked, the copies to the GPU can overlap the step before
        return inputs.map_tensors(torch.Tensor.pin_memory) if self.pin else inputs

    def get(self, m: int) -> StepInputs:
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
