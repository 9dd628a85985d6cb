"""Distributed runtime: rank discovery, process groups, CPU tuning.

Nothing here knows about models; ``hpcdl.train`` wires models to this package.
"""
