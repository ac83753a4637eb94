"""Where and how the program runs: devices and precision, processes and ranks,
signals, exits, the terminal, and paths on the command line.

This folder belongs to the template: `copier update` keeps improving it.
"""
