"""`fulcrum tune`: the order of operations on a workload, every kept change measured."""
