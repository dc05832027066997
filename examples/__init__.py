"""Models a user writes, as the docs show them (docs/custom_model.md): run from a clone."""
