"""The recipe: one YAML file that describes a whole run. Schema (one pydantic model per section, documented field by
field), loading (defaults < YAML < overrides, every problem reported at once), the YAML rules, and `explain`'s docs."""
