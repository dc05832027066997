"""Tests of hybridps/."""
