"""tools/schedule_table.py prints docs/algorithm.md's worked table."""

import pytest

from tools import schedule_table

# docs/algorithm.md, P=4, H=12, V=1.
EXPECTED = {"1-2": ("—", "—"), "3": ("1", "—"), "4": ("—", "1"), "5": ("—", "—"),
            "6": ("2", "—"), "7": ("—", "2"), "8": ("—", "—"), "9": ("3", "—"),
            "10": ("—", "3"), "11": ("—", "—"), "12": ("0", "—"), "13": ("—", "0")}


def test_prints_the_worked_table(capsys):
    schedule_table.main(["--sync-period", "12", "--num-fragments", "4", "--overlap-steps", "1",
                         "--steps", "13"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "H=12 P=4 V=1: Δh=3, H_eff=12"
    rows = {cells[0]: (cells[1], cells[2])
            for cells in ([c.strip() for c in line.split("|")] for line in out[3:])}
    assert rows == EXPECTED


def test_bad_knob_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        schedule_table.main(["--sync-period", "12", "--num-fragments", "4", "--overlap-steps", "12"])
    assert "overlap_steps (V) must be in [0, H_eff)" in capsys.readouterr().err
