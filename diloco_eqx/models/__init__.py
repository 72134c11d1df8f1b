"""The built-in model: a decoder-only transformer (`transformer`, the training CLI's default
`--model diloco_eqx.models.transformer:build`), models named PACKAGE.MODULE:FACTORY and saved
as plain Equinox files (`io`), and text sampled from a causal model (`sampling`)."""
