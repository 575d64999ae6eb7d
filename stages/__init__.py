"""The pipeline's stages: pure Python + torch, no Prefect. Each module states what it reads,
what it writes and what its key depends on."""
