"""The language-model task's own machinery: corpora, tokenizers, the prepared
token files, GPT-2 folders, compression and the model grid.

This folder belongs to the template: `copier update` keeps improving it.
"""
