"""Content-addressed artifact store and sample store. Knows nothing of diffusion."""
