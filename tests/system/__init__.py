"""Whole-system tests: fault campaigns, fuzzers, soak, the image and the GPU check."""
