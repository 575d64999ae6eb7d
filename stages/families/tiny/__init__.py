"""Tiny models built offline, one module per family (`lorapipe tiny-model DIR --arch ARCH`): random
weights from a fixed seed and tokenizers written or trained here, saved in the diffusers folder
layout so that they load through the code path a real model takes; every build is byte-identical
(tested). Each family's `build_tiny` calls its module; qwen.py holds the Qwen text encoder and
tokenizer that Flux.2-klein, Z-Image and Qwen-Image share, clip.py the CLIP text encoder and
tokenizer of the SD models and Flux.1; Z-Image takes Flux.1's VAE, ERNIE-Image Flux.2's VAE and
Flux.2-dev's Mistral3 config and tokenizer, HiDream-I1 Flux.1's VAE, T5 and (with more positions)
CLIP. florence.py is no family: it builds the caption
stage's tiny Florence-2 captioner.
"""
