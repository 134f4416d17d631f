"""`hftrain plan` on paper, before anyone rents a GPU: parameters, FLOPs and costs (estimates.py), the predicted
peak memory per process (memory.py), and the micro-batch and checkpointing that fit (fit.py, which
`parallelism.fit_memory: true` also uses at the start of `hftrain train`)."""
