"""What each CLI command does and prints (the parser lives in cli.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .config import load_config


def _print_json(value) -> None:
    print(json.dumps(value, indent=1, default=str))


def run(config_path: Path, overrides: list[str], only: list[str], start: str | None,
        force: list[str], as_json: bool) -> int:
    config = load_config(config_path, overrides)
    from .pipeline import pipeline, selected_stages

    selected_stages(only + force, start)  # reject an unknown stage name before Prefect starts
    summary = pipeline(config, only=only, start=start, force=force)
    if as_json:
        _print_json({"pipeline": config.name, "stages": summary})
        return 0
    print(f"\n{'stage':<11}{'status':<10}{'seconds':>9}  artifact")
    for row in summary:
        print(f"{row['stage']:<11}{row['status']:<10}{row['seconds']:>9.1f}  {row['path']}")
        if row["stage"] == "encode":
            i = row["info"]
            print(f"{'':<21}latents encoded {i.get('latents_encoded')}, reused {i.get('latents_reused')}; "
                  f"text embeddings encoded {i.get('texts_encoded')}, reused {i.get('texts_reused')}")
    out = config.output_dir
    for label, name in (("LoRA", "pytorch_lora_weights.safetensors"), ("sample grid", "grid.png"),
                        ("metrics", "metrics.json"), ("run summary", "run-summary.json")):
        if (out / name).exists():
            print(f"{label + ':':<13}{out / name}")
    return 0


def status(config_path: Path, overrides: list[str], as_json: bool) -> int:
    config = load_config(config_path, overrides)
    from .plan import STAGES, Context
    from .runner import explain

    ctx = Context(config)
    try:
        rows = explain(ctx, STAGES)
    finally:
        ctx.close()
    if as_json:
        _print_json({"pipeline": config.name, "stages": rows})
    else:
        for row in rows:
            key = (row["key"] or "?")[:12]
            print(f"{row['stage']:<11}{row['status']:<6}{key:<14}{row['reason']}")
    return 0


def _cache_root(args) -> Path:
    if args.config:
        return load_config(args.config).cache_dir
    root = args.cache_dir or Path("demo-run/cache")
    if not root.is_dir():
        raise FileNotFoundError(f"cache folder {root} does not exist (pass --cache-dir or --config)")
    return root


def cache(args) -> int:
    from cache.gc import collect
    from cache.store import ArtifactStore

    store = ArtifactStore(_cache_root(args))
    if args.action == "ls":
        rows = []
        for a in store.artifacts():
            uses = store.uses(a)
            size = sum(e["size"] for e in a.manifest["files"].values())
            rows.append({"stage": a.stage, "key": a.key, "bytes": size, "created": a.manifest["created"],
                         "last_used": max((u["time"] for u in uses), default=None),
                         "pipelines": sorted({u["pipeline"] for u in uses})})
        if args.json:
            _print_json(rows)
        for r in [] if args.json else rows:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_used"])) if r["last_used"] else "-"
            print(f"{r['stage']:<11}{r['key'][:12]:<14}{r['bytes']:>12,}  last used {used}  {','.join(r['pipelines'])}")
        return 0
    if args.action == "verify":
        bad = 0
        for a in store.artifacts():
            problems = store.verify(a)
            bad += bool(problems)
            print(f"{a.stage:<11}{a.key[:12]:<14}{'ok' if not problems else 'DAMAGED: ' + problems[0]}")
        return 1 if bad else 0
    if args.action == "rm":
        if not args.keys:
            raise ValueError("cache rm needs one or more artifact keys (see `lorapipe cache ls`)")
        for a in store.artifacts():
            if any(a.key.startswith(k) for k in args.keys):
                store.remove(a)
                print(f"removed {a.stage} {a.key}")
        return 0
    freed = collect(store, keep_seconds=args.keep_days * 86400)
    print(f"gc: removed {freed['artifacts']} artifacts and {freed['shards']} shards, freed {freed['bytes']:,} bytes")
    return 0
