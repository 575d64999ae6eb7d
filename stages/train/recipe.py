"""LoRA fine-tuning of a diffusion model's denoiser (SD's UNet, Flux's transformer: stages/families)
on cached latents and text embeddings.

The train stage's `run()` writes the training job into the work directory (stages/processes/jobs.py) and
runs it where its placement says; `run_job` below is its worker side. By hand (WORK/job.json as
`run()` writes it):

    # one process (CPU or one GPU), as the stage runs it when no accelerate config is given
    python -m lorapipe.stages.processes.jobs WORK/job.json
    # DDP: two GPUs, or two CPU processes over gloo (`--cpu` would start only one)
    accelerate launch --multi_gpu --num_processes 2 -m lorapipe.stages.processes.jobs WORK/job.json
    # the launch the stage uses for DDP (or with train.accelerate_config: that file)
    accelerate launch --config_file WORK/accelerate.yaml -m lorapipe.stages.processes.jobs WORK/job.json

Data: a deterministic batch plan. For each epoch, a permutation seeded by (seed, epoch) deals the
train split (ordered by latent record key, never by file name), bucket by bucket (one encoded
size per batch), into global batches of
batch_size x num_processes samples; a sample with `repeats` = k is dealt k times per epoch
(kohya-style), so a batch may hold it twice. A bucket's remainder that does not fill a global
batch is dropped for that epoch. Rank r takes slice r of each global batch, so every rank runs the
same number of steps. Micro-batch m = step * gradient_accumulation_steps + j is batch m of the
plan, and all of its randomness (flipped or plain latent where encode made both, posterior sample,
caption dropout, noise, timesteps, LoRA dropout) comes from a seed derived from (seed, m, rank),
and a training sample's caption variant (encode.caption_variants) from (seed, epoch, sample, copy):
resuming from a checkpoint is exact. Every record read is checked against its digest: a damaged
one stops the run (DamagedRecord, which the parent raises again for the flow to repair: stages/processes/placement.py). On CUDA,
threads prepare micro-batches before the step (stages/train/data.py: read, sample, noise, pin),
so the step itself is the copy to the device, the denoiser and the optimizer (train.loader_workers).
What differs between model families (objective, conditioning, the denoiser call, LoRA target
presets, export formats) comes from the family of the model (stages/families).

Logs: loss.jsonl (step, loss, lr, wall-clock time, the step's seconds) and loss.png, TensorBoard
(or wandb) through accelerate's trackers, and a progress line (tqdm's bar, it/s, ETA, loss) from the
main process at the first step, every log_every steps and the last.

Writes only into the work directory: checkpoints/ (see checkpoints.py), export/ (the final LoRA
files and train_config.json) and logs/loss.jsonl.
"""
from __future__ import annotations

import json
import math
import shutil
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object, send_to_device

from lorapipe.cache.errors import UserError
from lorapipe.stages import families
from lorapipe.stages.contract import Log
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.families.folders import empty_component
from lorapipe.stages.families.objectives import Objective
from lorapipe.stages.processes.jobs import Job
from lorapipe.stages.lora_formats.lora_folder import TRAIN_CONFIG, step_name
from lorapipe.stages.progress import progress_line
from lorapipe.stages.train.adapter import check_targets, kohya_network_dim_alpha, load_init_lora
from lorapipe.stages.train.block_swap import BlockSwap, swap_count, to_device_leaving
from lorapipe.stages.train.checkpoints import CheckpointDir
from lorapipe.stages.train.checkpointing import enable_gradient_checkpointing
from lorapipe.stages.train.compile import compile_blocks
from lorapipe.stages.train.data import BatchPlan, MicroBatches, StepInputs, derived_seed, prepare_micro_batch
from lorapipe.stages.train.experts import Expert, check_routable, experts_of, export_expert, routed
from lorapipe.stages.train.params import (TOTAL_DEPENDENT_SCHEDULES, TRACKER_RUN, VERSION, TrainInputs, TrainOptions,
                                          TrainParams, TrainResult, TrainSpec)
from lorapipe.stages.train.prior import base_output_target
from lorapipe.stages.train.quantization import keep_base_out_of_ddp_sync, quantize_base
from lorapipe.stages.train.trained_adapter import TrainedAdapter

LYCORIS_NETWORK_ARGS = {"dora": {"algo": "lora", "dora_wd": "True"}, "lokr": {"algo": "lokr"}, "loha": {"algo": "loha"}}


def step_loss(family: families.Family, objective: Objective, denoiser: torch.nn.Module, inputs: StepInputs,
              device: torch.device, dtype: torch.dtype, base_output_of: torch.nn.Module | None = None) -> torch.Tensor:
    """Score the denoiser's prediction for a prepared micro-batch with the objective's training loss.
    `base_output_of` (train.prior_target base_output): the unwrapped denoiser, whose prediction with
    its adapter off is the prior samples' target."""
    inputs = inputs.map_tensors(lambda t: t.to(device, non_blocking=True))
    target = inputs.target
    if base_output_of is not None and inputs.prior is not None:
        target = base_output_target(family, base_output_of, inputs, dtype)
    pred = family.predict(denoiser, inputs.noisy, inputs.timesteps, inputs.conditioning, dtype)
    return objective.loss(*family.loss_region(pred, target), inputs.loss_weight, inputs.loss_mask)


class LoRATrainingRecipe:
    """An adapter (LoRA, DoRA, LoKr or LoHa; rsLoRA, PiSSA/OLoRA init: stages/train/trained_adapter.py)
    on the denoiser's attention (or any linear) layers, with an optional EMA of its weights; the VAE
    and text encoders are never loaded: latents and embeddings come from the encode stage, so the
    text encoder is not trained.

    Features: every registered family (SD1.x/2.x, SDXL, Flux.1, ...), DDP (gloo on CPU), gradient
    accumulation, mixed precision (frozen weights in fp16/bf16, LoRA in fp32), the family's objective
    (min-SNR weighting, noise offset, epsilon/v/sample prediction; flow matching with timestep
    sampling, shift and loss weighting, Flux.1 dev's guidance input), caption dropout, dataset repeats, mirrored latents, a start from an existing LoRA file,
    prior preservation (a `role: prior` dataset's samples weighted by prior_loss_weight, or scored
    against the base model's prediction with prior_target base_output: one extra no-grad forward over
    a micro-batch's prior samples, stages/train/prior.py),
    gradient checkpointing (less memory, slower steps), torch.compile of the denoiser's blocks
    (compile.py), block swap (the frozen weights of the last
    blocks off the accelerator between their uses: less memory, slower steps, the same result;
    block_swap.py), exact resume from atomic checkpoints that hold only the adapter (with its
    PiSSA/OLoRA start and its EMA), optimizer, LR scheduler and RNG
    states, a LoRA on each of a model's denoisers in one run with train.denoiser both (each step
    routed to one: experts.py). A non-finite loss or LoRA weight stops the run before it can be
    checkpointed.
    """

    def __init__(self, params: TrainParams, inputs: TrainInputs, options: TrainOptions, work_dir: Path):
        self.params, self.inputs, self.options, self.work_dir = params, inputs, options, Path(work_dir)
        self.checkpoints = CheckpointDir(self.work_dir / "checkpoints")
        self.loss_log = self.work_dir / "logs" / "loss.jsonl"
        self.step = 0
        self.resumed_from: int | None = None

    # ---- setup
    def setup(self) -> None:
        from accelerate import Accelerator

        p, tracker = self.params, self.options.log_with
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=p.mixed_precision,
                                       log_with=None if tracker == "none" else tracker,
                                       project_dir=self.work_dir / "logs")
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        if self.world != p.num_processes:
            raise RuntimeError(f"launched with {self.world} processes but num_processes is {p.num_processes}")
        self._check_same_job()
        self._setup_data()
        latest = self._checkpoint_to_resume()
        self._setup_model(latest)
        self._setup_optimizer()
        self._register_checkpoint_hooks()
        self._resume(latest)
        if self.options.log_with != "none":
            self.accelerator.init_trackers(TRACKER_RUN, config=tracker_config(self.params))

    def _check_same_job(self) -> None:
        """Every process trains the same job: a machine started with other train settings or data
        than machine rank 0's stops them all, rather than train a plan nobody asked for."""
        job = json.dumps([self.params.model_dump(mode="json"), self.inputs.encoded_digest,
                          self.inputs.base_model_digest], sort_keys=True)
        jobs = gather_object([job])
        other = next((rank for rank, theirs in enumerate(jobs) if theirs != jobs[0]), None)
        if other is not None:
            raise UserError(f"process {other} was started with other train settings or data than machine rank"
                            " 0's: run the same config on every machine (only train.machine_rank differs)")

    def _setup_data(self) -> None:
        self.data = EncodedData(self.inputs.encoded_dir, self.inputs.cache_root)
        train = self.data.split("train")
        self.plan = BatchPlan(train, self.params.seed, self.params.batch_size, self.world)
        prior = sum(sample.role == "prior" for sample in train)
        print(f"rank {self.rank}/{self.world}: {len(train)} train samples{f' ({prior} prior)' if prior else ''},"
              f" {self.plan.batches_per_epoch}"
              f" global batches of {self.plan.global_batch} per epoch, {torch.get_num_threads()} torch threads",
              flush=True)

    def _setup_model(self, latest: int | None) -> None:
        p, model_path = self.params, self.inputs.model_path
        self.dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[p.mixed_precision]
        self.family = families.for_model(model_path)  # the model's, whichever denoisers train
        self.experts = experts_of(self.family, p.denoiser, model_path, p)
        self.unconditioned = self.family.objective(model_path, p)  # every noise level: what routes a step
        if len(self.experts) > 1:
            check_routable(self.unconditioned)
        for expert in self.experts:
            self._setup_expert(expert, latest)

    def _setup_expert(self, expert: Expert, latest: int | None) -> None:
        """Load one trained denoiser and give it its adapter (resumed from `latest`'s start if PiSSA/OLoRA)."""
        from diffusers.training_utils import cast_training_params

        p, model_path = self.params, self.inputs.model_path
        structure = empty_component(model_path, expert.family.components.denoiser)  # targets checked before loading
        targets = expert.family.lora_target_modules(structure, p.target_modules)
        check_targets(structure, p.adapter, targets)
        swapped = self._blocks_to_swap(structure)
        denoiser = expert.family.load_denoiser(model_path, self.dtype)
        denoiser.requires_grad_(False)
        quantize_base(denoiser, p.base_quantization, self.accelerator.device)
        blocks = families.swappable_blocks(expert.family, denoiser)
        if swapped:  # the swapped blocks' frozen weights stay on the host (BlockSwap takes them there)
            to_device_leaving(denoiser, self.accelerator.device, blocks[-swapped:])
        else:
            denoiser.to(self.accelerator.device)
        expert.adapter = TrainedAdapter(p, expert.family, targets)
        # the adapter's random init (each denoiser's its own, where there are several)
        torch.manual_seed(derived_seed(p.seed, "init", expert.name) if expert.name else derived_seed(p.seed, "init"))
        expert.adapter.add_to(denoiser, self._saved_start(latest, expert))
        expert.family.check_adapter(denoiser)  # before a step is spent on what export would refuse
        if p.init_lora:
            load_init_lora(denoiser, Path(p.init_lora), p, expert.family.components.adapter_prefix())
        cast_training_params(denoiser, dtype=torch.float32)
        keep_base_out_of_ddp_sync(denoiser, p.base_quantization)
        if self.options.gradient_checkpointing:
            enable_gradient_checkpointing(denoiser)
        if self.options.compile:
            compile_blocks(blocks)
        expert.block_swap = BlockSwap(blocks, swapped, self.accelerator.device) if swapped else None
        if swapped:
            self.accelerator.print(f"block swap: the last {swapped} of {len(blocks)} blocks"
                                   f"{f' of {expert.name}' if expert.name else ''} wait off"
                                   f" {self.accelerator.device} between their uses", flush=True)
        if self.accelerator.is_main_process:  # rank 0 alone saves and exports the EMA
            expert.adapter.start_ema(denoiser)
        expert.denoiser = denoiser

    def _blocks_to_swap(self, structure: torch.nn.Module) -> int:
        """How many of the denoiser's last blocks train.blocks_to_swap keeps off the accelerator (0: none)."""
        setting = self.options.blocks_to_swap
        return 0 if setting is None else swap_count(setting, len(families.swappable_blocks(self.family, structure)))

    def _setup_optimizer(self) -> None:
        from diffusers.optimization import get_scheduler

        p = self.params
        # the LoRA's tensors, listed once: walking denoiser.parameters() every step costs more than clipping; one
        # optimizer for every denoiser's: a step leaves another's gradients None, and AdamW skips those
        self.lora_params = [t for e in self.experts for t in e.denoiser.parameters() if t.requires_grad]
        settings = dict(lr=p.effective_learning_rate, weight_decay=p.weight_decay)
        if p.optimizer == "adamw8bit":
            from bitsandbytes.optim import AdamW8bit

            optimizer = AdamW8bit(self.lora_params, **settings)
        else:  # fused: one kernel for all tensors (faster than the default: BENCHMARKS.md)
            optimizer = torch.optim.AdamW(self.lora_params, fused=True, **settings)
        self.lr_scheduler = get_scheduler(p.lr_scheduler, optimizer, num_warmup_steps=p.warmup_steps,
                                          num_training_steps=p.max_steps)
        *prepared, self.optimizer = self.accelerator.prepare(*(e.denoiser for e in self.experts), optimizer)
        for expert, denoiser in zip(self.experts, prepared):
            expert.denoiser = denoiser
            # train.prior_target base_output: the prior samples' target is this model's output with its adapter off
            expert.base_output_of = self._lora_denoiser(expert) if p.prior_target == "base_output" else None
        # not prepare(): a prepared scheduler steps once per process per call
        self.accelerator.register_for_checkpointing(self.lr_scheduler)

    def _register_checkpoint_hooks(self) -> None:
        """Checkpoints hold the adapter only (save_state would write the whole denoiser)."""

        def save_hook(models, weights, output_dir):
            weights.clear()
            if self.accelerator.is_main_process:
                for expert in self.experts:
                    expert.folder(output_dir).mkdir(exist_ok=True)
                    expert.adapter.save(self._lora_denoiser(expert), expert.folder(output_dir), self.provenance())

        def load_hook(models, input_dir):
            models.clear()
            for expert in self.experts:
                expert.adapter.load(self._lora_denoiser(expert), expert.folder(input_dir))

        self.accelerator.register_save_state_pre_hook(save_hook)
        self.accelerator.register_load_state_pre_hook(load_hook)

    def _checkpoint_to_resume(self) -> int | None:
        """The newest intact checkpoint's step (None: start afresh). Only rank 0 reads checkpoints (on
        several machines the work directory is machine rank 0's); the other ranks are told."""
        found = self._find_checkpoint() if self.accelerator.is_main_process else None
        latest, problem = broadcast_object_list([found])[0]
        if problem:  # every rank stops on it, none waits for the others
            raise UserError(problem)
        return latest

    def _resume(self, latest: int | None) -> None:
        """Resume from `latest`: rank 0 loads it, the other ranks receive what it loaded."""
        acc = self.accelerator
        if latest is None:
            if acc.is_main_process:
                self._truncate_loss_log(0)
            return
        if acc.is_main_process:
            acc.load_state(str(self.checkpoints.path(latest)))
        self._receive_state_from_rank_0()
        self.step = self.resumed_from = latest
        previous_total = self.checkpoints.max_steps_of(latest) if acc.is_main_process else None
        if acc.is_main_process and previous_total != self.params.max_steps \
                and self.params.lr_scheduler in TOTAL_DEPENDENT_SCHEDULES:
            acc.print(f"lr schedule '{self.params.lr_scheduler}' recomputed for max_steps"
                      f" {self.params.max_steps} (the checkpoint was made for {previous_total})")
        # the optimizer's saved lr follows the old total; the scheduler's lambda follows the new one
        s = self.lr_scheduler
        for group, base_lr, fn in zip(self.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
            group["lr"] = base_lr * fn(s.last_epoch)
        if acc.is_main_process:
            self._truncate_loss_log(latest)
        acc.print(f"resumed from {step_name(latest)}")

    def _find_checkpoint(self) -> tuple[int | None, str | None]:
        """On rank 0: (the newest intact checkpoint's step or None, the user's error or None)."""
        self.checkpoints.remove_staging()
        self.loss_log.parent.mkdir(parents=True, exist_ok=True)
        try:
            latest = self.checkpoints.latest_intact(warn=self.accelerator.print)
        except UserError as error:
            return None, str(error)
        if latest is not None and latest > self.params.max_steps:
            return None, (f"{self.checkpoints.path(latest)} is past train.max_steps={self.params.max_steps}: run a"
                          " shorter training through the train stage (`lorapipe run`), which trains it beside this one")
        return latest, None

    def _saved_start(self, latest: int | None, expert: Expert) -> dict[str, torch.Tensor] | None:
        """A resumed PiSSA/OLoRA run's initial adapter, read by rank 0 and sent to the others."""
        if latest is None or self.params.init == "default":
            return None
        checkpoint = expert.folder(self.checkpoints.path(latest))
        start = expert.adapter.saved_start(checkpoint) if self.accelerator.is_main_process else None
        return broadcast_object_list([start])[0] if self.world > 1 else start

    def _receive_state_from_rank_0(self) -> None:
        """The LoRA, optimizer, LR scheduler (and loss scaler) state rank 0 loaded, on every rank.
        Per-rank RNG states are not needed: every draw is seeded by (seed, micro-batch, rank)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return
        state = None
        if acc.is_main_process:
            state = send_to_device({
                "lora": [t.detach() for t in self.lora_params], "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "scaler": acc.scaler.state_dict() if acc.scaler is not None else None}, "cpu")
        state = broadcast_object_list([state])[0]
        if acc.is_main_process:
            return
        with torch.no_grad():
            for tensor, value in zip(self.lora_params, state["lora"]):
                tensor.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if acc.scaler is not None:
            acc.scaler.load_state_dict(state["scaler"])

    # ---- training
    def train(self) -> None:
        for expert in self.experts:
            expert.denoiser.train()
        self.batches = self.micro_batches()
        try:
            self._train_loop()
        finally:
            self.batches.close()
            for expert in self.experts:
                if expert.block_swap is not None:  # every weight in its place again, for the export
                    expert.block_swap.remove()

    def micro_batches(self) -> MicroBatches:
        """The micro-batches from the current step to max_steps, prepared before the step needs them."""
        accumulation, cuda = self.params.gradient_accumulation_steps, self.accelerator.device.type == "cuda"
        workers = self.options.loader_workers if self.options.loader_workers is not None else 2 if cuda else 0
        return MicroBatches(self._prepare, self.step * accumulation, self.params.max_steps * accumulation,
                            workers, pin=cuda)

    def _prepare(self, micro_batch: int) -> StepInputs:
        expert = self._routed(micro_batch // self.params.gradient_accumulation_steps)
        return prepare_micro_batch(self.data, self.plan, expert.family, expert.objective, self.params, micro_batch,
                                   self.rank)

    def _routed(self, step: int) -> Expert:
        """The denoiser that trains optimizer step `step` (0-based; experts.py says how)."""
        return routed(self.experts, self.unconditioned, self.params.seed, step)

    def _train_loop(self) -> None:
        p, acc = self.params, self.accelerator
        started, started_step = time.perf_counter(), self.step
        while self.step < p.max_steps:
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
            step_started = time.perf_counter()
            expert = self._routed(self.step)
            loss = self._train_step(expert)
            self.step += 1
            if not torch.isfinite(loss):
                self._stop(f"loss is {loss.item()} at step {self.step}")
            for each in self.experts:
                each.adapter.update_ema(self.step)
            if acc.is_main_process:
                row = {"step": self.step, "loss": loss.item(), "lr": lr, "time": round(time.time(), 3),
                       "seconds": round(time.perf_counter() - step_started, 4),  # wall clock; the step's duration
                       **({"denoiser": expert.name} if expert.name else {})}  # which one trained it, of several
                with open(self.loss_log, "a") as f:
                    f.write(json.dumps(row) + "\n")
            acc.log({"loss": loss.item(), "lr": lr}, step=self.step)
            if self.step in (started_step + 1, p.max_steps) or self.step % self.options.log_every == 0:
                acc.print(progress_line("step", self.step, p.max_steps, time.perf_counter() - started, started_step,
                                        note=f" loss {loss.item():.5f} lr {lr:.3e}"
                                        f"{f' ({expert.name})' if expert.name else ''}"), flush=True)
            if self.step == started_step + 1 and acc.is_main_process:
                # the loss plot's library, imported while the other steps run (before the first, it delayed it)
                threading.Thread(target=import_plotting, name="import-matplotlib", daemon=True).start()
            if self.step % p.checkpoint_every == 0 or self.step == p.max_steps:
                if not all(torch.isfinite(t).all() for t in self.lora_params):
                    self._stop(f"the LoRA weights are not finite after step {self.step}")
                self.save_checkpoint()

    def _stop(self, what: str) -> None:
        """Stop before anything non-finite is checkpointed; every committed checkpoint stays."""
        last = self.checkpoints.steps()
        kept = f"{self.checkpoints.path(last[-1])} is kept" if last else "there is no checkpoint yet"
        raise FloatingPointError(f"{what}; training stopped and {kept}. Lower train.learning_rate or check the data.")

    def _train_step(self, expert: Expert) -> torch.Tensor:
        """One optimizer step of `expert` over gradient_accumulation_steps micro-batches; returns the
        mean loss over micro-batches and ranks."""
        p, acc = self.params, self.accelerator
        losses = []
        for j in range(p.gradient_accumulation_steps):
            micro_batch = self.step * p.gradient_accumulation_steps + j
            inputs = self.batches.get(micro_batch)
            if p.dropout:  # LoRA dropout draws from the global generator
                torch.manual_seed(derived_seed(p.seed, "dropout", micro_batch, self.rank))
            last = j == p.gradient_accumulation_steps - 1
            with nullcontext() if last else acc.no_sync(expert.denoiser):
                loss = step_loss(expert.family, expert.objective, expert.denoiser, inputs, acc.device, self.dtype,
                                 expert.base_output_of)
                acc.backward(loss / p.gradient_accumulation_steps)
            losses.append(loss.detach())
        acc.clip_grad_norm_(self.lora_params, p.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return acc.gather(torch.stack(losses).mean().reshape(1)).mean()

    # ---- checkpoints and outputs
    def save_checkpoint(self) -> None:
        """On rank 0 only (the other ranks hold the same LoRA, optimizer and scheduler state): stage,
        seal and commit step-XXXXXX, then drop the checkpoints no longer kept."""
        acc = self.accelerator
        if acc.is_main_process:
            acc.save_state(str(self.checkpoints.staging(self.step)))
            self.checkpoints.commit(self.step, self.params.max_steps)
            self.checkpoints.rotate(self.step, self.params.checkpoint_every, self.params.keep_checkpoints)
        acc.wait_for_everyone()

    def export(self) -> TrainResult | None:
        """The final LoRA in the family's formats (diffusers first) and the training config, into
        work_dir/export/; the main process returns the training's result (the other processes none)."""
        if not self.accelerator.is_main_process:
            return None
        out = self.work_dir / "export"
        shutil.rmtree(out, ignore_errors=True)  # only this run's files are published
        out.mkdir(parents=True)
        for expert in self.experts:
            written = export_expert(expert, self._lora_denoiser(expert), out, self.provenance(), self.kohya_metadata())
            for note in expert.family.export_notes(self._lora_denoiser(expert), written):
                print(f"train: note: {note}", flush=True)
        config = {**self.train_config(), "steps": self.step}
        (out / TRAIN_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        result = TrainResult(steps=self.step, resumed_from=self.resumed_from)
        (self.work_dir / "logs" / "summary.json").write_text(json.dumps(result.model_dump()) + "\n")
        plot_losses(self.loss_log, self.work_dir / "logs" / "loss.png")
        return result

    def train_config(self) -> dict:
        """What produced these weights. Leaves out max_steps (the files record their step), so a
        checkpoint's bytes do not depend on the max_steps of the run that wrote it."""
        return {
            "version": VERSION, "params": self.params.model_dump(mode="json", exclude={"max_steps", "init_lora"}),
            "target_modules": sorted(self.experts[0].adapter.config.target_modules),
            "base_model_digest": self.inputs.base_model_digest, "encoded_digest": self.inputs.encoded_digest,
            "init_lora_digest": self.inputs.init_lora_digest, "family": self.family.name,
        }

    def provenance(self) -> dict[str, str]:
        return {
            "lorapipe.base_model_digest": self.inputs.base_model_digest,
            "lorapipe.encoded_digest": self.inputs.encoded_digest,
            "lorapipe.train_config": json.dumps(self.train_config(), sort_keys=True),
            "lorapipe.steps": str(self.step),
        }

    def kohya_metadata(self) -> dict[str, str]:
        p = self.params
        dim, alpha = kohya_network_dim_alpha(p)
        values = {
            "ss_network_dim": dim, "ss_network_alpha": alpha,
            "ss_network_dropout": p.dropout, "ss_learning_rate": p.effective_learning_rate,
            "ss_unet_lr": p.effective_learning_rate, "ss_text_encoder_lr": 0, "ss_lr_scheduler": p.lr_scheduler,
            "ss_lr_warmup_steps": p.warmup_steps, "ss_max_train_steps": p.max_steps, "ss_steps": self.step,
            "ss_seed": p.seed, "ss_batch_size_per_device": p.batch_size, "ss_mixed_precision": p.mixed_precision,
            "ss_gradient_accumulation_steps": p.gradient_accumulation_steps, "ss_max_grad_norm": p.max_grad_norm,
            "ss_noise_offset": p.noise_offset, "ss_min_snr_gamma": p.snr_gamma, "ss_caption_dropout_rate": p.caption_dropout,
            "ss_network_train_unet_only": True, "ss_cache_latents": True,
            "ss_new_sd_model_hash": self.inputs.base_model_digest, **self._kohya_caption_metadata(),
        }
        if p.adapter in LYCORIS_NETWORK_ARGS:
            values.update(ss_network_module="lycoris.kohya",
                          ss_network_args=json.dumps(LYCORIS_NETWORK_ARGS[p.adapter]))
        return {k: str(v) for k, v in values.items()}

    def _kohya_caption_metadata(self) -> dict:
        """kohya's names for the caption augmentation encode made variants with (none without)."""
        captions = self.data.caption_augmentation
        return {"ss_shuffle_caption": captions["shuffle_tags"], "ss_keep_tokens": captions["keep_tokens"],
                "ss_caption_tag_dropout_rate": captions["tag_dropout"]} if captions else {}

    def cleanup(self) -> None:
        self.accelerator.end_training()

    def _lora_denoiser(self, expert: Expert) -> torch.nn.Module:
        return self.accelerator.unwrap_model(expert.denoiser)

    def _truncate_loss_log(self, step: int) -> None:
        """Forget losses logged after `step` by a run that died before its next checkpoint."""
        if not self.loss_log.exists():
            return
        lines = [line for line in self.loss_log.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.loss_log.write_text("".join(line + "\n" for line in lines))


def tracker_config(params: TrainParams) -> dict[str, str | int | float | bool]:
    """The params as TensorBoard hparams accept them (scalars only)."""
    values = params.model_dump(mode="json")
    return {k: v if isinstance(v, (str, int, float, bool)) else json.dumps(v) for k, v in values.items()}


def import_plotting():
    """matplotlib with its file-only backend, imported only when a plot is drawn (BENCHMARKS.md, start-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(loss_log: Path, png: Path) -> None:
    """The loss per step and its moving average (a window of about 5% of the run)."""
    plt = import_plotting()

    entries = [json.loads(line) for line in loss_log.read_text().splitlines() if line]
    steps, values = [e["step"] for e in entries], [e["loss"] for e in entries]
    window = max(1, math.ceil(len(values) / 20))
    smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
              for i in range(len(values))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, values, lw=0.6, alpha=0.4, label="loss")
    ax.plot(steps, smooth, lw=1.5, label=f"mean of {window}")
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def warm_up() -> None:
    """In the warm process, before its first job (stages/processes/jobs.py): import what training needs."""
    import accelerate  # noqa: F401
    import diffusers.optimization  # noqa: F401
    import diffusers.training_utils  # noqa: F401
    import peft  # noqa: F401  (diffusers.training_utils brings every family's model classes)


def run_job(job: Job[TrainSpec], log: Log) -> TrainResult | None:
    """Train as the job says (written by the stage: stages/train/launch.py); the main process returns
    the result. Each process prints its own lines, which the stage's placement streams (`log` is the
    stage's in the calling process)."""
    recipe = LoRATrainingRecipe(job.spec.params, job.spec.inputs, job.spec.options, job.work_dir)
    recipe.setup()
    recipe.train()
    result = recipe.export()
    recipe.cleanup()
    return result
