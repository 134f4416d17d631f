"""training.report_to checked before a run does anything: each tracker name transformers knows (with the recipe),
and its library installed here (when the run is resolved: the machine that trains needs it, not one that plans or
writes a launch script). transformers itself finds either only when the Trainer is built (its callback's
RuntimeError, after the tokenizer was trained and the output directory written).

The names are the keys of transformers' INTEGRATION_TO_CALLBACK; whether a tracker can run is transformers' own
`is_*_available` function for it (TRACKERS), so hftrain refuses exactly what the Trainer would. A name a newer
transformers adds is checked against its get_available_reporting_integrations() and installed by its own name.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from hftrain.errors import HftrainError

KEY = "training.report_to"
ALONE = ("none", "all")  # no tracker / every tracker installed here: each means something only alone

# report_to name -> (its availability function in transformers.integrations.integration_utils, what installs it:
# the pip command transformers' own callback names, or None for a tracker that is not a library)
TRACKERS: dict[str, tuple[str, str | None]] = {
    "azure_ml": ("is_azureml_available", "azureml-sdk"),
    "comet_ml": ("is_comet_available", "comet-ml"),
    # the tracking client, as hftrain's `trackers` extra installs it
    "mlflow": ("is_mlflow_available", "mlflow-skinny"),
    "neptune": ("is_neptune_available", "neptune"),
    "tensorboard": ("is_tensorboard_available", "tensorboard"),
    "trackio": ("is_trackio_available", "trackio"),
    "wandb": ("is_wandb_available", "wandb"),
    "codecarbon": ("is_codecarbon_available", "codecarbon"),
    "clearml": ("is_clearml_available", "clearml"),
    "dagshub": ("is_dagshub_available", "dagshub mlflow-skinny"),
    "flyte": ("is_flytekit_available", "flytekit"),
    "dvclive": ("is_dvclive_available", "dvclive"),
    "swanlab": ("is_swanlab_available", "swanlab"),
    "kubeflow": ("is_kubeflow_available", None),  # KUBEFLOW_TRAINER_SERVER_URL, set inside a Kubeflow TrainJob
}
# Variables that turn a tracker off in transformers although its library is installed.
TURNED_OFF = {"mlflow": "DISABLE_MLFLOW_INTEGRATION", "kubeflow": "DISABLE_KUBEFLOW_INTEGRATION"}


def named(report_to: Any) -> list[str]:
    """The tracker names report_to asks for ("none", "all" and None ask for none by name)."""
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else [str(n) for n in report_to]
    return [] if names in (["none"], ["all"]) else names


def check_names(report_to: Any) -> Any:
    """Every name is one transformers knows (a recipe field check: the message gets the key in front)."""
    from hftrain.recipe.transformers_table import tracker_names

    known = tracker_names()  # transformers' INTEGRATION_TO_CALLBACK, from the table kept per version
    names = named(report_to)
    for name in names:
        if name in ALONE:
            meaning = "no tracker" if name == "none" else "every tracker installed here"
            raise ValueError(f"{name!r} means {meaning} and stands alone; give it alone, or a list of tracker names")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(
                f"{name!r} is not a tracker transformers knows; {hint}give none, all, or some of: {', '.join(known)}"
            )
    return report_to


def check_installed(report_to: Any) -> None:
    """Refuse, before the run does anything, a tracker that cannot run here: its library not installed (with the pip
    command), or turned off."""
    from transformers.integrations import integration_utils

    missing = [name for name in dict.fromkeys(named(report_to)) if not _available(integration_utils, name)]
    if not missing:
        return
    off = [name for name in missing if os.environ.get(TURNED_OFF.get(name, ""), "").upper() == "TRUE"]
    if off:
        name = off[0]
        raise HftrainError(
            f"{KEY}: {name} is turned off here ({TURNED_OFF[name]}=TRUE); "
            f"unset {TURNED_OFF[name]}, or remove {name} from {KEY}."
        )
    if "kubeflow" in missing:
        raise HftrainError(
            f"{KEY}: kubeflow reports to the Kubeflow TrainJob the run is in, and KUBEFLOW_TRAINER_SERVER_URL is not "
            f"set here (a TrainJob sets it); run inside a Kubeflow TrainJob, or remove kubeflow from {KEY}."
        )
    packages = " ".join(_package(integration_utils, name) for name in missing)
    what = "the library is" if len(missing) == 1 else "their libraries are"
    raise HftrainError(
        f"{KEY}: {' and '.join(missing)} cannot report: {what} not installed here; "
        f"run `pip install {packages}`, or remove "
        f"{'it' if len(missing) == 1 else 'them'} from {KEY} (none: no tracker)."
    )


def _available(integration_utils: Any, name: str) -> bool:
    check = getattr(integration_utils, TRACKERS.get(name, ("", None))[0], None)
    if check is None:  # a name this table does not know: transformers' list of the installed ones
        return name in integration_utils.get_available_reporting_integrations()
    return bool(check())


def _package(integration_utils: Any, name: str) -> str:
    package = TRACKERS.get(name, ("", name))[1] or name
    least = getattr(integration_utils, "_MIN_COMET_VERSION", None) if name == "comet_ml" else None
    return f"'{package}>={least}'" if least else package
