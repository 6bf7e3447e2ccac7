"""``pagedserve calibrate``: the flags of the command that makes a simulator's cost model."""

from __future__ import annotations


def add_sim_parsers(sub) -> None:
    from pagedserve.args import add_engine_args
    from pagedserve.sim.calibrate import cmd_calibrate

    c = sub.add_parser("calibrate", help="Time steps of known shape on this GPU and fit the cost model that "
                                         "`bench sweep --simulate` and `tune --simulate` run ladders on.")
    add_engine_args(c)
    c.add_argument("--output", required=True, help="The calibration file to write (JSON).")
    c.set_defaults(func=cmd_calibrate)
