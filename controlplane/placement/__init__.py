"""Placement: filters and a SQL shortlist, atom pick and scorers in Python, a guarded commit."""
