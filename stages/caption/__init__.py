"""Caption: generated captions for a dataset's images (issue 28, CAPTION-DESIGN.md), the dataset
review a person scans (review.py) and the generated captions exported as sidecars (export.py)."""
