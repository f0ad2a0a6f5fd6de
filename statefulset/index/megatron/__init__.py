"""megatron-core 0.16's GPTDataset sample order (``gpt``, ``sample_index``) and BlendedDataset (``blend``), exactly."""
