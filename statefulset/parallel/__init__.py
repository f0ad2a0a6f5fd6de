"""Parallelism: the pure rank layout (``layout``), process groups and errors raised on every rank
(``groups``), bounded meetings of DP ranks (``arrival``), TP broadcast and the stage link (``transfer``).
"""
