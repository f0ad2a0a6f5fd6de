"""The dataset spec: the YAML/dict model with its validation (``model``) and split strings (``splits``)."""
