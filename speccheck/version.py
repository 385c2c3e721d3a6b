"""The version, in a module of its own so that recording it in a run imports nothing else."""
__version__ = "0.1.0"
