"""Workload axes: the regimes where spec-decode bugs live, each a deterministic generator of
requests from the corpus (one module per axis, ``AXIS = AxisSpec(...)``).

An axis names what it guards, its default levels, how to build a level's workload, and the proof
keys the engine (or the runner, for what it sent) must read back as non-zero for the level to
count as exercised. Its verdict is a check (``speccheck/checks/axis_<name>.py``): an axis that
was asked for but not exercised fails there, naming the axis -- never a pass.
"""
from speccheck.axes._registry import AxisInput, AxisSpec, get, names, registry

__all__ = ["AxisInput", "AxisSpec", "get", "names", "registry"]
