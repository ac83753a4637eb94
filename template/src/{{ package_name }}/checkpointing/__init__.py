"""Checkpoints: writing and reading them (single-file and sharded), the step
checkpoints in the background, which one a resume takes, and the run folder.

This folder belongs to the template: `copier update` keeps improving it.
"""
