"""The README and docs/: commands paste as written, samples and flags are current."""
