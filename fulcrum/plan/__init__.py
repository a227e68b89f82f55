"""`fulcrum plan`: what a model needs (memory, GPUs) and how fast it can go (roofline), from its config alone."""
