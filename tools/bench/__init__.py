"""The benchmark's measurements, one module each; `python -m tools.benchmark` is their command line.

common: sizes, meshes, the model, paired statistics and what a JSON records of its machine;
steps: the steps under test and how one is timed; table: the step table (phases, amortized,
compiles, FLOPs); memory: each mode's extra memory against its formula; sync_cost,
references and sync_summary: what a sync adds against the bytes it must move; nonsync:
full-batch steps without an event; placement: the deferred exchange waiting or free;
workers, host_memory and orders: settings made before JAX starts, in worker processes;
report: the printed tables.
"""
