"""`python -m app convert CKPT --to-zero N --to-world W [--out DIR]`: a checkpoint made loadable
under another ZeRO stage and world size, offline (no process group, no accelerator).

Writes the checkpoint's universal form (app/checkpoint/universal.py): every parameter whole, with
its fp32 master and both Adam moments, the step and the LR schedule. `train --resume` does the same
by itself when it meets a checkpoint of another layout; converting ahead is for big checkpoints (the
conversion then does not run inside the job, under its collective timeout) and to check a switch
before a cluster is booked. The source is never modified.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.checkpoint import tags, universal
from data_tools import output
from data_tools.errors import UserError

KIND, COMMAND = "universal checkpoint", "app convert"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", type=Path, metavar="CKPT",
                        help="a run directory, its checkpoints/ directory or one tag directory")
    parser.add_argument("--to-zero", type=int, required=True, choices=(0, 1, 2, 3),
                        metavar="N", help="the ZeRO stage the run will resume with (0-3)")
    parser.add_argument("--to-world", type=int, required=True, metavar="W",
                        help="the number of ranks the run will resume with")
    parser.add_argument("--to-precision", choices=("fp32", "bf16", "fp16"),
                        help="the precision it will resume with (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where to write (default: next to the tag, TAG.universal, where "
                             "train --resume finds it)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier conversion at --out")


def run(args: argparse.Namespace) -> int:
    if args.to_world < 1:
        raise UserError(f"--to-world {args.to_world}: must be at least 1")
    ckpt_dir, tag = tags.find_at(args.ckpt, "CKPT")
    source = ckpt_dir / tag
    if universal.is_universal(source):
        raise UserError(f"{source}: already a converted checkpoint; resume from it directly "
                        f"(any stage and world size)")
    state = tags.read_state(ckpt_dir, tag)
    if not tags.check_files(source):  # verified against its manifest, or said
        print(tags.unverified_note(source), file=sys.stderr)
    saved = universal.saved_layout(state)
    target = universal.Layout(args.to_zero, args.to_world, args.to_precision or saved.precision,
                              saved.offload if args.to_zero > 0 else False,
                              universal.partition_blocks(args.to_zero))
    why_not = universal.convertible_into(target, "--to-zero")
    if why_not:
        raise UserError(f"--to-zero {args.to_zero}: {why_not}")
    gbs = int(state["global_batch"])
    if gbs % args.to_world:
        print(f"note: the global batch of {gbs} samples does not divide over {args.to_world} "
              f"ranks; resume with --global-batch a multiple of {args.to_world} (the run "
              f"continues from sample {state['consumed_samples']:,})", file=sys.stderr)
    out = args.out or universal.path_for(ckpt_dir, tag)
    if args.out is not None:
        output.claim(out, KIND, COMMAND, overwrite=args.overwrite, inputs=[("CKPT", source)])
    elif universal.is_universal(out) and not args.overwrite:
        print(f"{out}: already converted (--overwrite converts again)", file=sys.stderr)
        return 0
    print(f"converting {source} ({saved}) for {target}", file=sys.stderr, flush=True)
    from app.models.build import skeleton_group_names  # transformers: only once there is work to do

    # the names of a ZeRO-0 checkpoint's parameters where its train state predates them
    universal.write(source, state, out, command=COMMAND, target=target,
                    names_for=skeleton_group_names)
    info = universal.read_info(out)
    print(f"wrote {out}: {len(info['parameters'])} parameters, step {info['step']}; resume "
          f"with `launch.sh ... --zero {args.to_zero} --resume {out}` on {args.to_world} "
          f"rank{'s' * (args.to_world > 1)}", file=sys.stderr)
    print(out)
    return 0
