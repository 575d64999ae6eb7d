"""LoRA file formats: the floor below the families.

How an adapter's weights are named and written in each file format that loaders read, and read
back: the diffusers format with its safetensors metadata (diffusers_format.py), the kohya and
ComfyUI spellings of a LoRA on the original (non-diffusers) module names with fused projections
(original_names.py), and DoRA, LoKr and LoHa in ComfyUI's LyCORIS keys (lycoris.py); where the
files lie in a trained LoRA's folder, which train writes and evaluate reads (lora_folder.py).

Nothing here knows a model family: a family passes in its module names (`OriginalNames`), and
train and evaluate read and write the files through these modules. They import only the shared
contracts and libraries, never a family or a stage.
"""
