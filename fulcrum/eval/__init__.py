"""Quality checks a user runs before shipping a cheaper configuration: perplexity, and KL divergence against a
reference run (after llama.cpp's `perplexity --kl-divergence`)."""
