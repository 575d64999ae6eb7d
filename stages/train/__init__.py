"""Train: LoRA fine-tuning of the denoiser on the encoded shards, launched with accelerate.

Reads:  the encode artifact (samples.json) and the sample store records it points to; the
        model's denoiser and noise scheduler (never the VAE or text encoders), through its family.
        It refuses encoded data another model's encoders made, and objective settings that do not
        apply to the model's family, in one line before anything starts.
Writes: out_dir/pytorch_lora_weights.safetensors        diffusers format (load_lora_weights)
        out_dir/pytorch_lora_weights_*.safetensors      the family's other formats (SD: kohya and
                                                        ComfyUI; Flux.1: kohya and ComfyUI), ss_* metadata
        out_dir/ema/pytorch_lora_weights*.safetensors   with train.ema_decay: the same files of the EMA
        out_dir/train_config.json                       what produced the weights
        out_dir/checkpoints/step-XXXXXX/pytorch_lora_weights.safetensors  every retained checkpoint
        out_dir/logs/{loss.jsonl, train.log, summary.json}  (not part of the artifact digest)
        Both LoRA files carry provenance metadata: base model and encoded data digests, config, steps.
Key:    TrainParams (less max_steps for the work directory: raising it resumes; a shorter training
        runs in a folder of its own there, stages/train/shorter.py), the encode
        artifact's digest, the denoiser and scheduler digests, library majors.
Work:   work_dir/checkpoints/ (adapter, PiSSA/OLoRA start, EMA, optimizer, LR scheduler and RNG states;
        atomic: stages/train/trained_adapter.py), export/, shorter/ (a shorter training's own folder),
        logs/, accelerate.yaml, job.json (stages/processes/jobs.py). Training resumes from the newest intact checkpoint.
Across machines (train.num_machines): machine rank 0 runs `run` (it alone reads and writes the
        work directory and publishes); every other machine runs `follow`, whose processes join
        rank 0's and keep only their job and log in a private folder.

The text encoder is not trained (its embeddings are cached), and caption dropout uses the cached
empty-prompt embedding. The recipe itself is `stages/train/recipe.py`.
"""
from lorapipe.stages.train.launch import follow, machines, run, unused_libraries, where
from lorapipe.stages.train.params import OUTPUT_FILES, VERSION, TrainInputs, TrainOptions, TrainParams

RESUMABLE = ("max_steps",)  # TrainParams fields left out of the work directory's key

__all__ = ["VERSION", "OUTPUT_FILES", "RESUMABLE", "TrainParams", "TrainOptions", "TrainInputs", "run", "follow",
           "machines", "unused_libraries", "where"]
