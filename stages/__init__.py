"""The pipeline's stages: pure Python + torch, no Prefect. Each module states what it reads,
what it writes and what its key depends on.

Floors, each importing only those below it: the stage packages (preprocess, caption,
encode, train, evaluate), with what they share about the encoded data and the model (encoded.py, models.py);
the model families (families/); the LoRA file formats (lora_formats/); the contracts every stage
shares (contract.py, cpu_threads.py, progress.py, ...)."""
