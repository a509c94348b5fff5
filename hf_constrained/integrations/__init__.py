"""Integrations with other training libraries. Each submodule imports its library on import
and only then: ``hf_constrained.integrations.trl`` needs ``pip install 'hf_constrained[trl]'``."""
