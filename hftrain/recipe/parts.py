"""What each component reads of the recipe: one frozen part per component, holding only the sections (and the
few values derived from them) that component needs, built from a Recipe by its ``of``.

The resolver (training/resolve.py) builds them once per run; a component imports its part, never the Recipe, so
what it can depend on is written in one place and a newcomer reads a component without the whole schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hftrain.recipe.schema import Recipe
