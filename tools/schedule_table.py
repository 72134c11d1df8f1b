"""Print the Streaming DiLoCo schedule: which fragment is synced and applied at each step.

    python -m tools.schedule_table --sync-period 12 --num-fragments 4 --overlap-steps 1 --steps 13
"""

from __future__ import annotations

from diloco_eqx.schedule import Schedule


def format_table(schedule: Schedule, steps: int, all_steps: bool = False) -> str:
    """The table as text; steps with neither a sync nor an apply are folded unless asked."""
    lines = [
        f"H={schedule.sync_period} P={schedule.num_fragments} V={schedule.overlap_steps}: "
        f"Δh={schedule.steps_between_syncs}, H_eff={schedule.period}",
        f"{'t':>6} | {'sync fragment':>13} | {'apply fragment':>14}",
        f"{'-' * 6}-+-{'-' * 13}-+-{'-' * 14}",
    ]
    quiet: list[int] = []

    def flush():
        if quiet:
            label = str(quiet[0]) if len(quiet) == 1 else f"{quiet[0]}-{quiet[-1]}"
            lines.append(f"{label:>6} | {'—':>13} | {'—':>14}")
            quiet.clear()

    for t, sync, apply in schedule.table(steps):
        if sync is None and apply is None and not all_steps:
            quiet.append(t)
            continue
        flush()
        show = lambda f: "—" if f is None else str(f)  # noqa: E731
        lines.append(f"{t:>6} | {show(sync):>13} | {show(apply):>14}")
    flush()
    return "\n".join(lines)


def main(argv=None) -> None:
    from diloco_eqx.training.cli import Parser, add_flags, from_flags

    parser = Parser(prog="python -m tools.schedule_table", description=__doc__.splitlines()[0])
    add_flags(parser, Schedule())
    parser.add_argument("--steps", type=int, default=None, help="steps to show (default H_eff + V + 1)")
    parser.add_argument("--all", action="store_true", help="one row per step, quiet ones too")
    args = parser.parse_args(argv)
    try:
        schedule = from_flags(Schedule(), args)
    except ValueError as e:
        parser.error(str(e))
    steps = args.steps if args.steps is not None else schedule.period + schedule.overlap_steps + 1
    print(format_table(schedule, steps, args.all))


if __name__ == "__main__":
    main()
