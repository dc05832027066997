"""Test-only helpers (servers on port 0, spawned ranks, the reference trainer); no tests."""
