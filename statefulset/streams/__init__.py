"""Sample streams: a spec's split opened (``opening``) into a stream whose ``stream[p]`` is a pure function
of (spec, p); the stream base, one module per packing, the open log (``overview``) and provenance.
"""
