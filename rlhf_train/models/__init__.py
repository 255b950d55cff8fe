"""Layer 2, models: the three models of RLHF and how they score sequences.

The three models are the policy (with its value head), the frozen reference and the reward model. All
three are ordinary ``transformers`` models: rlhf_train adds two small heads on a transformer trunk (a
value head, a scalar reward head) and one rule: every per-token quantity (log-probs, values, reference
log-probs, rewards) comes from **one forward pass over prompt + response**, with logits computed only at
the response positions (the LM head is the most expensive matmul for small models with big vocabularies).

Loading causal LMs by name or path (``loading``, GGUF files through ``gguf``), a damaged model dir in one
line (``model_dirs``), the policy with its value head and the reference's model (``policy``), the reference
as one object of kind copy | adapter_off | ray (``reference``), LoRA adapters (``lora``), the trained policy
as a plain HF model dir (``export``), one forward pass over prompt + response for log-probs and hidden
states (``scoring``), the same pass over sequences packed without padding (``packed``, ``update.packing``), reward models (``reward_model``, ``hf_reward_model``) and the reference as a named Ray
actor (``ray_reference``).

May import: ``rlhf_train.core`` and ``rlhf_train.infra``.
"""
