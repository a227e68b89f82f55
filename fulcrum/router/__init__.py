"""`fulcrum router` and `fulcrum autoscale`: an OpenAI-compatible front over many replicas (fulcrum, vLLM or
SGLang), cache-aware routing, and an SLO-driven autoscaler. It talks to replicas over HTTP and /metrics only."""
