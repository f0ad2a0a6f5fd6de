"""Loading: ``WorkerConfig``, datasets (a stream cut into a rank's micro-batches), the savable loader,
its state (cursor and codec) and the placeholder loader of ranks that load nothing.
"""
