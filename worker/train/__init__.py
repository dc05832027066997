"""The training loop, its pipeline and time budget, and the single-process reference it
must equal. May import every room (it is the last).
"""
