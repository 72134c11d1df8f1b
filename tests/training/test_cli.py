"""cli: a field's docstring becomes its flag's help as written, a percent sign included."""

import argparse
import dataclasses

from diloco_eqx.training.cli import add_flags


@dataclasses.dataclass(frozen=True)
class Knobs:
    share: float = 0.5
    """Fraction kept, 50% by default (argparse would read "% b" as a format)."""


def test_help_keeps_percent_signs():
    parser = argparse.ArgumentParser()
    add_flags(parser, Knobs())
    text = " ".join(parser.format_help().split())
    assert 'Fraction kept, 50% by default (argparse would read "% b" as a format).' in text
