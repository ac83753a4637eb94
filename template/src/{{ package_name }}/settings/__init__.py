"""The settings machinery: the config's base class, its checks, and parsing the
command line and config files into it. Your `config.py` builds on it.

This folder belongs to the template: `copier update` keeps improving it.
"""
