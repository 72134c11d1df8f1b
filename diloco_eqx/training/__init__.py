"""Training infrastructure around the algorithm: run configs and the command line derived
from them (`config`, `cli`), the run itself (`runner`), data (`data`), the loop (`loop`),
checkpoints (`checkpoint`), multi-process runs (`multiprocess`) and loss plots (`plots`).

Nothing in the algorithm imports this package.
"""
