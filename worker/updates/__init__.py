"""Row updates on the training thread: the sources' interface, the local optimizer, the
staleness window and its weight prediction. May import: config, runtime, embedding, dense, tasks.
"""
