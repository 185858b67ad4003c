"""P-EAGLE speculative-decoding drafts: train on Kubeflow, serve with vLLM."""
__version__ = "0.1.0"
