"""Support code for the tests, not tests themselves.

* fake servers, each with its pytest fixtures (registered once, by ``pytest_plugins`` in ``tests/conftest.py``):
  ``hub`` (``local_hub``: a local Hugging Face Hub, with ``hub_*`` modules), ``s3`` (``s3_server``, ``s3``: moto's
  S3 server; ``s3_proxy`` has the fault-injecting proxy) and ``gcs`` (``gcs``: a local GCS JSON API endpoint);
* ``data``: generated documents and tiny recipes; ``cli``: running ``python -m hftrain`` as a user would;
* ``checks``: the checks tests share (per-step losses, straight-vs-resumed runs, copying a checkpoint).
"""

import pytest

# Plain `assert`s in these modules report their values like those in the tests (pytest's assertion rewriting).
pytest.register_assert_rewrite("tests.support")
