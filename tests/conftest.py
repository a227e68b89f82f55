import os

import torch

# FULCRUM_NUM_THREADS=1 keeps tests from fighting a concurrent job (oversubscribed OpenMP threads spin)
torch.set_num_threads(int(os.environ.get("FULCRUM_NUM_THREADS", "2")))
