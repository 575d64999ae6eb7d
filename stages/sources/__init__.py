"""Where a base model's files come from: a local folder or file, a Hugging Face repo, and the
component files composed over a base; each resolved into a diffusers folder the stages load."""
