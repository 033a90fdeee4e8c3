"""`vflash run-workflow`: execute an API-format ComfyUI workflow of Vflash nodes without ComfyUI."""

from __future__ import annotations

import argparse
import json
import os

MODELS_DIR_HINT = "give a ComfyUI install's models folder, e.g. --models-dir ~/ComfyUI/models"

COMMANDS = {
    "run-workflow": "run an API-format ComfyUI workflow of Vflash nodes headless (no ComfyUI install needed)",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-workflow",
        help=COMMANDS["run-workflow"],
        description=(
            "Runs the output nodes of an API-format workflow (ComfyUI 'Export (API)', e.g. workflows/api/t2va.json) "
            "and their ancestors: every Vflash node, plus stand-ins for core EmptyMiniMaxH3LatentAV, CreateVideo, "
            "SaveVideo, LoadImage and LoadAudio. Other core nodes are refused before anything runs. 'embedded-demo' "
            "models are built on first use in the cache folder."
        ),
    )
    p.add_argument("workflow", help="API-format workflow JSON")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="NODE.INPUT=VALUE",
        help="override a widget value; NODE is a node id or its title; VALUE is JSON or a plain string (repeatable)",
    )
    p.add_argument("--output-dir", default="output", help="where SaveVideo writes (default: ./output)")
    p.add_argument(
        "--input-dir", default="input", help="where LoadImage / LoadAudio read file names from (default: ./input)"
    )
    p.add_argument(
        "--models-dir", help="a ComfyUI-style models folder (vflash/, diffusers/, diffusion_models/ or unet/, loras/)"
    )
    p.add_argument("--print-plan", action="store_true", help="check the workflow, print the execution order and exit")
    p.set_defaults(handler=_run)


def check_folders(output_dir: str, input_dir: str, models_dir: str | None) -> None:
    """Before anything runs: the output folder is a folder or can be created (no part of its path is a file), a
    given --models-dir exists, and --input-dir, if present, is a folder."""
    from pathlib import Path

    from vflash_core.fileio import check_folder, nearest_existing

    from .workflow import WorkflowError

    existing = nearest_existing(Path(output_dir).absolute())
    if not existing.is_dir():
        raise WorkflowError(f"--output-dir {output_dir} cannot be a folder: {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise WorkflowError(f"--output-dir {output_dir} is not writable")
    if models_dir is not None:
        check_folder(models_dir, "--models-dir", WorkflowError, MODELS_DIR_HINT)
    if os.path.lexists(input_dir) and not Path(input_dir).is_dir():
        raise WorkflowError(f"--input-dir {input_dir} is not a folder")


def _run(args: argparse.Namespace) -> int:
    from .workflow import apply_overrides, headless_node_types, load_api_workflow, plan, run_headless

    check_folders(args.output_dir, args.input_dir, args.models_dir)
    workflow = apply_overrides(load_api_workflow(args.workflow), args.sets)
    if args.print_plan:
        with headless_node_types(args.output_dir, args.input_dir, args.models_dir) as types:
            order = plan(workflow, types)
        print(" -> ".join(f"{nid} {workflow[nid]['class_type']}" for nid in order))
        return 0
    saved = run_headless(workflow, output_dir=args.output_dir, input_dir=args.input_dir, models_dir=args.models_dir)
    for path in saved:
        print(f"wrote {path}")
    print(json.dumps({"outputs": [str(p) for p in saved]}))
    return 0
