"""GPT model: Megatron layer spec (transformer-engine or local + SDPA attention), build, FLOP count.

``angelgpt.model.flops`` needs no torch; import ``angelgpt.model.gpt`` for the model itself.
"""
