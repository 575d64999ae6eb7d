"""The thin orchestration layer: config, stage plan, Prefect flow and the `lorapipe` CLI."""
