"""Measuring what the algorithm does, outside it: collectives and bytes read from compiled
HLO (`comms`), the data dependencies of the traced step (`critical_path`), a bandwidth and
utilisation simulator (`simulator`), compile counts, memory and FLOPs (`profiling`).

Nothing in the algorithm imports this package.
"""
