"""eagle3-datagen: EAGLE-3 training data from a reasoning LLM served by vLLM."""

__version__ = "0.1.0"
