"""What a run shows and leaves: the console's progress and lines, the loss-curve PNG,
TensorBoard scalars. May import: config, runtime, embedding, dense, tasks, updates, sync.
"""
