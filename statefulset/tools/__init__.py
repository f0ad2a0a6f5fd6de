"""Tools around the loader: preprocessing, progress, shard inspection, the spec preview,
the command line and the demo.
"""
