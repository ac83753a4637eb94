"""The training loop and what it drives: the task (loss, evaluation), the data
sources, metrics, schedules, EMA and the Muon optimizer.

This folder belongs to the template: `copier update` keeps improving it.
"""
