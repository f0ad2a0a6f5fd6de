"""Megatron bin/idx shards: the ``.idx`` format, storage (local mmap or fsspec), the reader, the writer,
merging, direct I/O, temporaries of killed writers, file-version facts, content digests, and the
tokenizers that say what the tokens mean.
"""
