"""Example models of your own, outside the installed package: run from a checkout with
`--model models.conv:build` (the current directory is importable). The built-in transformer
is `diloco_eqx.models.transformer`."""
