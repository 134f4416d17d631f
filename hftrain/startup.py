"""Start-up time: imports a run does not need.

accelerate's ``unwrap_model`` (called by the Trainer's __init__, its saves and hftrain's evaluation) imports
DeepSpeed whenever the package is installed, to check whether the model is a ``DeepSpeedEngine``: 1.8-3.6 s on
a 2-core CPU, every run, ZeRO-3 or not (DeepSpeed 0.19 also imports mlflow through its autotuner). A model can
only be a DeepSpeedEngine if DeepSpeed was imported first, so answering accelerate's check with "is deepspeed
already imported, and installed" gives the same unwrapping in every case, without the import. Only
``accelerate.utils.other`` (where ``extract_model_from_parallel`` lives) sees the narrower check; every other
DeepSpeed check in accelerate and transformers is untouched.
"""

from __future__ import annotations

import sys


def skip_unneeded_imports() -> None:
    """Install the narrower DeepSpeed check for accelerate's model unwrapping (idempotent)."""
    try:
        from accelerate.utils import other
    except ImportError:  # another accelerate layout: keep its behaviour (slower start, same results)
        return
    check = getattr(other, "is_deepspeed_available", None)
    if check is None or getattr(check, "hftrain_narrowed", False):
        return

    def deepspeed_in_use() -> bool:
        return "deepspeed" in sys.modules and check()

    deepspeed_in_use.hftrain_narrowed = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = deepspeed_in_use
