"""The PPO algorithm and its models: generation, inference and training of actor, critic, reward
and reference on tiny or real Llama-architecture decoders.

``model`` (the decoders, Hugging Face names), ``weights`` (loading checkpoints by name),
``parallel`` (DTensor tensor parallelism), ``generate`` (the generation backend), ``algorithm``
(GAE, PPO losses, KL control), ``tasks`` (synthetic prompts and programmatic rewards) and
``trainer_local`` (the single-process step loop).
"""
