"""`trainwise doctor`: the job's preflight checklist on the machines it will run on: the
flags parsed, trainwise.api's doctor called, the checklist printed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trainwise.api import doctor_job
from trainwise.cli.train import add_job_arguments, job_spec
from trainwise.config.schema import CHECK_NAMES
from trainwise.errors import ConfigError

if TYPE_CHECKING:
    from trainwise.doctor.result import DoctorRecord


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="preflight checklist: versions, bandwidth, data, scaling, smoke test, memory, disk",
        description="Run the checks on every worker of the job (same flags and TOML as "
        "`trainwise train`) and print a numbered checklist. Writes RUN_DIR/doctor.json, "
        "which `trainwise plan --calibrate RUN_DIR` reads. Exit 1 when a check failed.",
    )
    add_job_arguments(p)
    p.add_argument(
        "--only",
        metavar="CHECKS",
        help=f"comma-separated subset of: {','.join(CHECK_NAMES)} (doctor.checks)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--html", metavar="FILE", help="also write the checklist as an HTML page")
    p.set_defaults(run=run)


def parse_only(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown or not names:
        raise ConfigError(
            f"--only {text!r}: {', '.join(unknown) or 'no check named'} is not a check; "
            f"choose from {', '.join(CHECK_NAMES)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    spec = job_spec(args, {"doctor.checks": (parse_only(args.only), "--only")})
    result = doctor_job(spec)
    if result.message:  # rank 0 is on another machine
        print(f"trainwise: {result.message}")
        return 0
    return 0 if result.record is None else show(result.record, args)


def show(record: DoctorRecord, args: argparse.Namespace) -> int:
    """Print the checklist (or the JSON), write the page; the exit status."""
    from trainwise.report.doctor_view import render_html, render_terminal

    if args.json:
        sys.stdout.write(record.model_dump_json(indent=1) + "\n")
    else:
        render_terminal(record)
    if record.calibration_file and not args.json:
        print(f"calibration: {record.calibration_file} (later plans and runs on this "
              "machine kind use it)")
    if args.html:
        try:
            Path(args.html).write_text(render_html(record))
        except OSError as err:
            raise ConfigError(f"--html {args.html}: cannot be written ({err.strerror})") from None
        if not args.json:
            print(f"page: {args.html}")
    return 1 if record.failed else 0
