"""Everything that starts processes or writes what starts them: the backends' processes on this machine
(processes.py: torchrun/accelerate, the CPU launcher), several nodes and their scripts (multinode.py), the checks
every launch script passes before it is written (script_checks.py), SageMaker jobs (sagemaker*.py), and the parity
checks that run a recipe under each backend (parity.py, elastic_parity.py). The launcher's store, the children's
exit codes and which processes are still there live in parallel/ (launcher_store.py, child_errors.py,
liveness.py): the processes themselves use them."""
