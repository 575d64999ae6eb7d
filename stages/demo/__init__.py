"""The data `lorapipe demo` and the tests train on, made offline: the bundled photos and their
captions (photos.py), edit pairs drawn from them (pairs.py) and generated clips (clips.py)."""
