"""Sweeps: many trainings over one encode (`sweep:` in a config, or `lorapipe sweep CONFIG --grid
key=v1,v2`), each variant an ordinary train + evaluate with its own cache key, compared in one
report, the best variant's files published to output_dir/best/."""
