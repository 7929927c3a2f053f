"""Distributed layout and collectives (process groups, data/sequence-parallel ranks)."""
