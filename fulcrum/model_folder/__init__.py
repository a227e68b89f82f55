"""What a model folder is and where one comes from, without torch: a local folder, a Hub ID found in the local
Hugging Face cache, or a GGUF file rebuilt as a folder (source.py, from_gguf.py); and the facts fulcrum reads from
a folder's config.json (hf_config.py). config.py builds the engine's ModelConfig on top of it."""
