"""`trl-distill report OUTPUT_DIR [--into DIR]`: a run's curves (``report.png``) and summary (``report.md``)."""

from __future__ import annotations

import argparse

from .errors import errors_as_messages


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="trl-distill report", description=__doc__)
    parser.add_argument("output_dir", help="the run's output_dir (its trainer_state.json, or its checkpoints')")
    parser.add_argument("--into", default=None, help="where to write report.png and report.md (default: output_dir)")
    args = parser.parse_args(argv)
    with errors_as_messages():
        from ..report import load_history, write_report

        for path in load_history(args.output_dir).passed_over:
            print(f"{path} cannot be read (cut short?): passed over for an older trainer_state.json")
        picture, text = write_report(args.output_dir, args.into)
    print(f"Report written: {picture} and {text}")
