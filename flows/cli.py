"""The `lorapipe` command line.

    lorapipe demo [--arch ARCH]... [--edit] [--caption] [--workdir DIR] [--set key=value]...
    lorapipe run CONFIG [--only S]... [--from S] [--force S]... [--set key=value]... [--strict] [--json]
    lorapipe sweep CONFIG [--grid key=v1,v2]... [--set key=value]... [--concurrency N] [--yes] [--dry-run]
                   [--strict] [--json]
    lorapipe status CONFIG [--set key=value]... [--strict] [--json]
    lorapipe model CONFIG [--set key=value]... [--json]
    lorapipe cache ls|verify|rm|gc [--cache-dir DIR | --config CONFIG] [--keep-last N] [--keep-days D | --since DATE]
    lorapipe captions export CONFIG [DIR]... [--overwrite] [--set key=value]... [--json]
    lorapipe tiny-model DIR [--arch ARCH]            ARCH: a tiny model of the family registry (stages/families),
                                                     or `captioner` (the tiny captioner of `demo --caption`)

Every command takes --debug. An error ends the command with one line, `lorapipe: error: ...`, and
a non-zero exit code (2 for a bad config, 1 otherwise); a run's traceback is in its log file
(flows/runlog.py), and --debug prints it too. Ctrl-C ends it with one line saying what was kept
(training: the step it reached and the checkpoint a rerun resumes from) and exit code 130.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from lorapipe.cache.errors import UserError
from lorapipe.stages.processes.launching import skip_exit_collection
from lorapipe.stages.processes.library_notes import quiet_harmless_notes
from lorapipe.stages.processes.optional_libraries import hide

from .command_errors import error_line, exit_code
from .run_record import RunRecord, recording

STRICT = ["preprocess.on_bad_row=error"]  # --strict: a bad metadata row stops the run
INTERRUPTED = "interrupted; run again to resume (finished stages stay cached)"  # Ctrl-C outside training
FLOW_COMMANDS = ("demo", "run", "sweep")  # the commands that run the pipeline in this process
HIDING_COMMANDS = (*FLOW_COMMANDS, "tiny-model")  # those that never use bitsandbytes or torchao in this process
PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorapipe", description="Cached LoRA fine-tuning of diffusion models")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print tracebacks and everything Prefect logs")
    sub = p.add_subparsers(dest="command", required=True)
    _add_demo(sub, common)
    _add_pipeline_commands(sub, common)
    _add_cache(sub, common)
    _add_captions(sub, common)
    _add_tiny_model(sub, common)
    return p


def _add_overrides(cmd: argparse.ArgumentParser, help: str | None = None) -> None:
    cmd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=help)


def _add_demo(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from lorapipe.stages.families import tiny_arches

    arches = list(tiny_arches())
    demo = sub.add_parser("demo", parents=[common], help="a tiny model through the whole pipeline on the bundled photos"
                          " (a video arch: on generated clips)")
    demo.add_argument("--workdir", type=Path, default=Path("demo-run"))
    demo.add_argument("--arch", choices=arches, action="append", help=f"the tiny model to train (default"
                      f" {arches[0]}); given several times, each family's demo in turn in WORKDIR/ARCH, in one"
                      " process, one Prefect server and one process started ahead for them all")
    demo.add_argument("--edit", action="store_true", help="train edit pairs generated from the bundled photos (a"
                      " family that takes reference images; an edit model's demo always does)")
    demo.add_argument("--caption", action="store_true", help="the bundled photos without captions, captioned by a"
                      " tiny captioner (the caption stage) before training")
    _add_overrides(demo, "change a setting of the demo's config for this run (train.max_steps=50)")
    demo.add_argument("--json", action="store_true")


def default_arch() -> str:
    """The arch `lorapipe demo` trains without --arch: the registry's first."""
    from lorapipe.stages.families import tiny_arches

    return next(iter(tiny_arches()))


def _add_pipeline_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """run, sweep and status: a config's pipeline; model: its base model."""
    run = sub.add_parser("run", parents=[common], help="run a config's pipeline")
    sweep = sub.add_parser("sweep", parents=[common], help="train and evaluate a config's variants over one encode;"
                           " report them, publish the best (docs/sweeps.md)")
    status = sub.add_parser("status", parents=[common], help="per stage: hit or miss and why, without running")
    model = sub.add_parser("model", parents=[common], help="the base model: its family and, per component, its"
                           " source, class, dtype, parameters and digest")
    for cmd in (run, sweep, status, model):
        cmd.add_argument("config", type=Path)
        _add_overrides(cmd)
        cmd.add_argument("--json", action="store_true")
    for cmd in (run, sweep, status):
        cmd.add_argument("--strict", action="store_true", help="a bad metadata row stops the run"
                         " (preprocess.on_bad_row: error)")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="values to try for"
                       " one key (replacing the config's sweep.grid values of that key)")
    sweep.add_argument("--concurrency", type=int, metavar="N", help="variants trained at once (sweep.concurrency)")
    sweep.add_argument("--yes", action="store_true", help="train more variants than sweep.max_variants")
    sweep.add_argument("--dry-run", action="store_true", help="list the variants, each a cache hit or a training,"
                       " and train nothing")
    run.add_argument("--only", action="append", default=[], metavar="STAGE")
    run.add_argument("--from", dest="start", metavar="STAGE")
    for cmd in (run, sweep):  # a sweep forces its shared stages once, the others for every variant
        cmd.add_argument("--force", action="append", default=[], metavar="STAGE")


def _add_cache(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    cache = sub.add_parser("cache", parents=[common], help="manage the artifact store")
    cache.add_argument("action", choices=["ls", "verify", "rm", "gc"])
    cache.add_argument("keys", nargs="*", help="rm: artifact keys or key prefixes")
    where = cache.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", help="a cache folder, or s3://bucket/prefix")
    where.add_argument("--config", type=Path)
    cache.add_argument("--keep-last", type=int, default=0, metavar="N",
                       help="gc: keep what each pipeline's last N completed runs used")
    cache.add_argument("--keep-days", type=float, help="gc: keep artifacts used this recently (default 30)")
    cache.add_argument("--since", metavar="DATE", help="gc: keep artifacts used on or after DATE (2026-11-01)")
    cache.add_argument("--json", action="store_true")


def _add_captions(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    captions = sub.add_parser("captions", parents=[common], help="the caption stage's generated captions")
    captions.add_argument("action", choices=["export"], help="export: write each generated caption as a sidecar"
                          " next to its image (the dataset's caption_ext, default .txt)")
    captions.add_argument("config", type=Path)
    captions.add_argument("folders", nargs="*", type=Path, metavar="DIR", help="only these dataset folders of the"
                          " config (default: all)")
    captions.add_argument("--overwrite", action="store_true", help="replace a caption file already there")
    _add_overrides(captions)
    captions.add_argument("--json", action="store_true")


def _add_tiny_model(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from lorapipe.stages.families import tiny_arches, tiny_model_names

    tiny = sub.add_parser("tiny-model", parents=[common], help="build a tiny model offline")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--arch", choices=tiny_model_names(), default=list(tiny_arches())[0],
                      help="a family's tiny model, or `captioner`: the tiny captioner of `demo --caption`")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in HIDING_COMMANDS:  # not in-process callers' status or cache (tests: pytest's own process)
        hide()  # the flow's stages never use them (training runs in its own processes), nor does a tiny model's build
    for name, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    quiet_harmless_notes()
    if args.command == "demo":
        os.environ.setdefault("PREFECT_HOME", str((args.workdir / "prefect").resolve()))
    with recording() as record:
        try:
            return _dispatch(args)
        except KeyboardInterrupt as interrupt:  # one line, no traceback; a stage's own (Interrupted) says how far it got
            return failed(args, record, str(interrupt) or INTERRUPTED, 130)
        except Exception as error:
            if args.debug:
                traceback.print_exc()
            return failed(args, record, f"error: {error_line(error)}", exit_code(error))
        finally:
            if args.command in FLOW_COMMANDS:  # a process that imported Prefect, and diffusers for an in-process stage
                skip_exit_collection()


def failed(args: argparse.Namespace, record: RunRecord, line: str, exit_code: int) -> int:
    """The command's one line on stderr and, with --json, one document on stdout saying what ran."""
    print(f"lorapipe: {line}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps(record.failure(line, exit_code), indent=1, default=str))
    return exit_code


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "demo" and args.json and len(args.arch or ()) > 1:
        raise UserError("demo --json: give one --arch (each demo's summary is one JSON document)")
    if args.command in FLOW_COMMANDS:
        from .server import EmbeddedServer

        server = EmbeddedServer.unless_configured()  # its start-up overlaps everything until the flow
    from . import commands

    if args.command == "demo":
        from .demo import prepare_demo

        arches = args.arch or [default_arch()]
        if len(arches) > 1:
            return commands.demos(args.workdir, arches, args.edit, args.caption, args.overrides, args.debug, server)
        config = prepare_demo(args.workdir, arches[0], args.edit, args.caption)
        return commands.run(config, args.overrides, [], None, [], args.json, args.debug, server)
    if args.command == "run":
        return commands.run(args.config, args.overrides + STRICT * args.strict, args.only, args.start, args.force,
                            args.json, args.debug, server)
    if args.command == "sweep":
        return commands.sweep(args.config, args.overrides + STRICT * args.strict, args.grid, args.concurrency,
                              args.json, args.debug, server, args.yes, args.dry_run, tuple(args.force))
    if args.command == "status":
        return commands.status(args.config, args.overrides + STRICT * args.strict, args.json)
    if args.command == "model":
        return commands.model(args.config, args.overrides, args.json)
    if args.command == "cache":
        return commands.cache(args)
    if args.command == "captions":
        return commands.captions_export(args.config, args.overrides, args.folders, args.overwrite, args.json)
    from lorapipe.stages.families import build_tiny_model

    print(build_tiny_model(args.dir, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
