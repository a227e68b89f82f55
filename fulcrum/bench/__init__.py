"""`fulcrum bench`: a load generator that measures any OpenAI-compatible server over HTTP."""
