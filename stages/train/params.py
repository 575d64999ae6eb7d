"""The train stage's settings and inputs, and its job's spec and result. Imports nothing heavy: flows
load this to build keys, and a training process reads its job with it before hiding libraries."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from lorapipe.cache.store import LOG_DIR
from lorapipe.stages.contract import Frozen, JsonInputs, OutputFile, json_form
from lorapipe.stages.families import DENOISER_NAMES, ObjectiveParams
from lorapipe.stages.lora_formats.lora_folder import EMA_DIR, LORA_FILE, LORA_FILES, expert_file
from lorapipe.stages.processes.jobs import JobResult
from lorapipe.stages.processes.optional_libraries import installed
from lorapipe.stages.train.adapter import AdapterParams
from lorapipe.stages.train.ema import EMAParams
from lorapipe.stages.train.quantization import BaseQuantization, check_available

VERSION = "4"  # bump by hand when the trained output's semantics change; 3: batch plan in content order;
# 4: sample-prediction models trained against the clean latent (they were trained against v)
LOSS_LOG = f"{LOG_DIR}/loss.jsonl"  # a row per step: step, loss, lr, time, seconds (stages/train/recipe.py)
LORA_OUTPUTS = tuple((expert_file(name, denoiser), denoiser) for denoiser in ("", *DENOISER_NAMES)
                     for name in LORA_FILES)  # (file, its denoiser): one set, or one per denoiser (train.denoiser both)
OUTPUT_FILES = (*(OutputFile(name, f"LoRA {denoiser}".strip() if name == expert_file(LORA_FILE, denoiser) else "")
                  for name, denoiser in LORA_OUTPUTS),
                *(OutputFile(f"{EMA_DIR}/{name}") for name, _ in LORA_OUTPUTS),  # the adapter's files, then its EMA's
                OutputFile(LOSS_LOG))  # the training curve, which a sweep's report overlays

PriorTarget = Literal["data", "base_output"]
TRACKER_RUN = "tracker"  # accelerate's tracker (TensorBoard, wandb) writes under work_dir/logs/tracker/
TOTAL_DEPENDENT_SCHEDULES = ("cosine", "linear", "polynomial")  # lr schedules whose every step depends on max_steps


class TrainParams(ObjectiveParams, AdapterParams, EMAParams):
    """Exactly the settings that change the trained LoRA (all keyed; max_steps is resumable:
    the work directory is keyed without it, so raising it continues from the latest checkpoint).
    The diffusion objective's settings (prediction_type, snr_gamma, noise_offset for the DDPM
    families; timestep_sampling, loss_weighting, guidance for the flow-matching ones) come from
    ObjectiveParams; the model's family refuses those that do not apply to it. The adapter (type,
    rank, alpha, dropout, rslora, init, lokr_factor) comes from AdapterParams, the EMA from EMAParams."""

    # ---- the adapter's modules (its type and size: AdapterParams)
    target_modules: Literal["attention", "attention_ff", "all_linear"] | tuple[str, ...] = Field(
        "attention", description="which layers get an adapter: a preset of the model's family (attention,"
        " attention_ff, all_linear) or a list of layer names, each matching the end of a name (to_out.0)")
    denoiser: str | None = Field(None, exclude_if=lambda v: v is None, description="a model with several"
                                 " denoisers (Wan 2.2 A14B: high_noise, low_noise): the one this LoRA trains, on"
                                 " the noise levels the model uses it at, or both: a LoRA for each in one run, each"
                                 " step training the one whose noise levels it draws (files named by denoiser);"
                                 " null for a model with one")
    init_lora: str | None = Field(None, description="start from this diffusers-format LoRA file instead of"
                                  " zero-initialised adapters (same rank, alpha and targets); keyed by its"
                                  " content, not its path")
    # ---- the frozen base
    base_quantization: BaseQuantization = Field(
        "none", exclude_if=lambda v: v == "none", description="store the frozen base's Linear weights as int8 or fp8 (torchao) or nf4 (bitsandbytes)"
        " to fit a big model on a small card (pip install 'lorapipe[quant]'); the adapter trains in full precision")
    # ---- optimisation (AdamW)
    learning_rate: float = Field(1e-4, gt=0, description="AdamW's learning rate (times the global batch with"
                                 " scale_lr)")
    scale_lr: bool = Field(False, description="multiply learning_rate by the global batch (batch_size x"
                           " num_processes x gradient_accumulation_steps)")
    lr_scheduler: Literal["constant", "constant_with_warmup", "cosine", "linear", "polynomial"] = Field(
        "constant", description="the learning rate's schedule over max_steps (recomputed for a new max_steps"
        " when training continues)")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up at the start of the schedule (not with"
                              " constant: use constant_with_warmup)")
    max_steps: int = Field(1000, gt=0, description="optimiser steps to train; raising it continues from the latest"
                           " checkpoint, lowering it trains beside the longer run and leaves it as it is")
    batch_size: int = Field(4, gt=0, description="samples per process per micro-batch")
    gradient_accumulation_steps: int = Field(1, gt=0, description="micro-batches per optimiser step")
    num_processes: int = Field(1, gt=0, description="training processes, of every machine together (DDP under"
                               " accelerate launch); part of the global batch, so keyed")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this norm")
    mixed_precision: Literal["no", "fp16", "bf16"] = Field("no", description="accelerate's mixed precision for the"
                                                           " denoiser's forward and backward pass")
    weight_decay: float = Field(1e-2, ge=0, description="AdamW's decoupled weight decay")
    optimizer: Literal["adamw", "adamw8bit"] = Field("adamw", description="adamw (torch) or adamw8bit"
                                                     " (bitsandbytes: optimizer states in 8 bits)")
    # ---- data
    caption_dropout: float = Field(0.0, ge=0, le=1, description="the probability that a draw trains on the"
                                   " cached empty prompt instead of its caption")
    seed: int = Field(0, ge=0, description="seeds the batch plan, the adapter's initialisation, noise, timesteps"
                      " and dropout")
    # ---- prior preservation: samples of datasets with role: prior (at their defaults out of the train key)
    prior_loss_weight: float = Field(1.0, gt=0, exclude_if=lambda v: v == 1.0, description="the loss weight of each"
                                     " prior sample (a subject sample's is 1), as kohya's and diffusers' DreamBooth")
    prior_target: PriorTarget = Field(
        "data", exclude_if=lambda v: v == "data", description="what a prior sample's prediction is scored against:"
        " data: the objective's target from its image (DreamBooth prior preservation); base_output: the frozen"
        " base model's prediction on the same noisy input, text and timestep (differential output preservation:"
        " one extra forward without the adapter over a batch's prior samples)")
    # ---- checkpoints (their LoRA weights are published, so they are part of the result)
    checkpoint_every: int = Field(100, gt=0, description="steps between checkpoints (and the last step's)")
    keep_checkpoints: int = Field(2, gt=0, description="the newest checkpoints kept; the published artifact holds"
                                  " their LoRA weights, which evaluate scores")

    @model_validator(mode="after")
    def _check(self) -> "TrainParams":
        if isinstance(self.target_modules, tuple) and not self.target_modules:
            raise ValueError("target_modules: give a preset name or at least one module name")
        check_available(self.base_quantization)
        if self.init != "default" and self.base_quantization != "none":
            raise ValueError(f"train.init {self.init} subtracts the adapter's start from the base weights, which"
                             f" train.base_quantization {self.base_quantization} keeps quantised: use init default")
        if self.init != "default" and self.prior_target == "base_output":
            raise ValueError(f"train.prior_target: base_output needs the adapter switched off to leave the base, but"
                             f" train.init {self.init} moves the base's principal components into it: use init default")
        if self.optimizer == "adamw8bit" and not installed("bitsandbytes"):
            raise ValueError("optimizer: adamw8bit needs bitsandbytes (pip install bitsandbytes), or use adamw")
        if self.warmup_steps and self.lr_scheduler == "constant":
            raise ValueError("warmup_steps is ignored by lr_scheduler 'constant': use 'constant_with_warmup'")
        return self

    @property
    def ema(self) -> EMAParams | None:
        """The EMA settings, None without train.ema_decay."""
        return EMAParams(**{k: getattr(self, k) for k in EMAParams.model_fields}) if self.ema_decay else None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_processes * self.gradient_accumulation_steps

    @property
    def effective_learning_rate(self) -> float:
        return self.learning_rate * self.global_batch if self.scale_lr else self.learning_rate


class TrainOptions(Frozen):
    """Settings that do not change the result. Gradient checkpointing recomputes the same
    activations (with the same RNG state) to save memory, so it trades speed, not outcome;
    compile changes float rounding only (stages/train/compile.py), as the thread count does."""

    log_every: int = Field(10, gt=0, description="print a progress line every N steps")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass: less"
                                         " memory, slower steps, the same result")
    blocks_to_swap: int | float | None = Field(
        None, gt=0, description="keep the frozen weights of the denoiser's last N blocks (or this fraction of its"
        " blocks, below 1) off the accelerator and bring each in just before it runs, forward and backward: a"
        " transformer bigger than the card trains, the same result, slower steps (docs/training.md); not with"
        " base_quantization or a PiSSA/OLoRA init")
    compile: bool = Field(False, description="torch.compile each block of the denoiser (transformer families): a slow"
                          " first step per input size, then compiled kernels; the same result up to float rounding, like"
                          " a change of cpu_threads, so not keyed; needs a C++ compiler on the CPU; not with"
                          " blocks_to_swap (docs/training.md)")
    loader_workers: int | None = Field(None, ge=0, description="threads preparing micro-batches before the"
                                       " step (read, sample, noise, pin), the same result; 0: in the step; default"
                                       " 2 on CUDA, 0 on CPU (where their share of the GIL slows the step)")
    log_with: Literal["tensorboard", "wandb", "none"] = Field(
        "tensorboard", description="accelerate tracker for loss and lr (files under the work dir's logs/)")
    cpu_threads: int | None = Field(None, gt=0, description="torch threads per training process; default: the"
                                    " config's cpu_threads")
    accelerate_config: str | None = Field(None, description="an `accelerate config` file to launch training with;"
                                          " default: accelerate's own default file when it exists, else one written"
                                          " by the stage (one process runs without accelerate's launcher)")
    # ---- several machines (docs/machines.md): where the processes run, not what they compute
    num_machines: int = Field(1, gt=0, description="machines training together; num_processes counts the"
                              " processes of all of them")
    machine_rank: int = Field(0, ge=0, description="this machine's rank; 0 checkpoints and publishes")
    main_process_ip: str | None = Field(None, description="the address of machine rank 0, reachable from every one")
    main_process_port: int = Field(29500, gt=0, lt=65536, description="a free port on machine rank 0")

    @model_validator(mode="after")
    def _tracker_installed(self) -> "TrainOptions":
        if self.log_with != "none" and not installed(self.log_with):
            raise ValueError(f"log_with: {self.log_with} is not installed (pip install {self.log_with}),"
                             " or set log_with: none")
        return self

    @model_validator(mode="after")
    def _swap_count_or_fraction(self) -> "TrainOptions":
        if isinstance(self.blocks_to_swap, float) and self.blocks_to_swap >= 1:
            raise ValueError(f"blocks_to_swap: {self.blocks_to_swap} is neither a number of blocks (a whole"
                             " number) nor a fraction of them (below 1)")
        return self

    @model_validator(mode="after")
    def _machines(self) -> "TrainOptions":
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank: {self.machine_rank} is not below num_machines ({self.num_machines})")
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError("main_process_ip: set it to the address of machine rank 0 when num_machines > 1")
        return self


@dataclass(frozen=True)
class TrainInputs(JsonInputs):
    encoded_dir: Path  # the encode artifact (samples.json)
    cache_root: Path  # holds the sample store the encode artifact points into
    model_path: Path  # a diffusers-format model folder
    base_model_digest: str  # provenance, written into the LoRA files' metadata
    encoded_digest: str
    init_lora_digest: str = "none"  # the content digest of params.init_lora (provenance)
    model_digests: dict[str, str] = field(default_factory=dict)  # the model's components: checked against the encoder's


class TrainSpec(Frozen):
    """The training job (stages/processes/jobs.py), as stages/train/launch.py writes it."""

    params: TrainParams
    inputs: json_form(TrainInputs)
    options: TrainOptions


class TrainResult(JobResult):
    """What a training reports besides its files (its main process's); also the user's logs/summary.json."""

    steps: int  # the last step trained
    resumed_from: int | None  # the checkpoint's step it resumed from; None: it started afresh
