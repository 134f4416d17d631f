"""Everything that starts or supervises processes: the backends' processes on this machine (processes.py:
torchrun/accelerate, the CPU launcher), several nodes and their scripts (multinode.py), SageMaker jobs
(sagemaker*.py), the launcher's store and the children's exit codes (launcher_store.py, child_errors.py), which
processes are still there (liveness.py), and the parity checks that run a recipe under each backend (parity.py,
elastic_parity.py)."""
