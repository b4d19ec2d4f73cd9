"""Engine adapters: a generated module behind LMDeploy's, vLLM's and transformers' KV-cache interfaces."""
