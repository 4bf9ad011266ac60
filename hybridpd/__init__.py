"""hybridpd: disaggregated prefill/decode serving for hybrid (attention + Mamba2) language models."""

__version__ = "0.1.0"
