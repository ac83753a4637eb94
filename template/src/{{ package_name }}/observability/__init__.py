"""What a run reports: trackers and model FLOPs utilization.

This folder belongs to the template: `copier update` keeps improving it.
"""
