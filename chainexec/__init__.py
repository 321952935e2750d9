"""chainexec: plans and runs chains of tensor contractions out of core (README.md)."""

__version__ = "0.1.0"
