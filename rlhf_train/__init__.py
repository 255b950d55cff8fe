"""rlhf_train: a Hydra-configured PPO/RLHF trainer."""
import os

# CPU defaults, set before torch is imported (both are read once); export either variable to override.
# * PyTorch's CPU allocator backs large tensors with transparent huge pages: the LM head's [tokens, V]
#   logits are hundreds of MB, allocated afresh every minibatch, and with 4 KB pages each allocation
#   costs ~40k page faults: 0.10 s per 160 MB on a 2-core CPU, 0.02 s with huge pages.
# * OpenMP threads that wait at a barrier sleep instead of spinning. Every multi-threaded op ends at a
#   barrier; on a CPU shared with other processes a spinning thread burns the time slice its partner
#   needs, and a 2-thread PPO iteration took 11-43 s instead of 6.5-8.6 s (load average 3.5-6 on 2 cores).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
