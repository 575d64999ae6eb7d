"""Train: LoRA fine-tuning of the UNet on the encoded shards, launched with accelerate.

Reads:  the encode artifact (samples.json) and the sample store records it points to; the
        model's UNet and noise scheduler (never the VAE or text encoders).
Writes: out_dir/pytorch_lora_weights.safetensors        diffusers format (load_lora_weights)
        out_dir/pytorch_lora_weights_kohya.safetensors  kohya/A1111/ComfyUI keys, ss_* metadata
        out_dir/train_config.json                       what produced the weights
        out_dir/checkpoints/step-XXXXXX/pytorch_lora_weights.safetensors  every retained checkpoint
        out_dir/logs/{loss.jsonl, train.log, summary.json}  (not part of the artifact digest)
        Both LoRA files carry provenance metadata: base model and encoded data digests, config, steps.
Key:    TrainParams (less max_steps for the work directory: raising it resumes), the encode
        artifact's digest, the UNet and scheduler digests, library majors.
Work:   work_dir/checkpoints/ (LoRA, optimizer, LR scheduler and RNG states; atomic), export/,
        logs/, accelerate.yaml, job.json. Training resumes from the newest intact checkpoint.

The text encoder is not trained (its embeddings are cached), and caption dropout uses the cached
empty-prompt embedding. The recipe itself is `stages/train/recipe.py`.
"""
from stages.train.launch import run
from stages.train.params import VERSION, TrainInputs, TrainOptions, TrainParams

RESUMABLE = ("max_steps",)  # TrainParams fields left out of the work directory's key

__all__ = ["VERSION", "RESUMABLE", "TrainParams", "TrainOptions", "TrainInputs", "run"]
