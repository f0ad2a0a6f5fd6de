"""Tools around the loader: tokenizers, preprocessing, progress, shard inspection, the spec preview,
the command line and the demo.
"""
