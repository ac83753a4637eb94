"""The image task's own machinery: decoding, folders and shards, augmentation,
hub models, fine-tuning and loading a trained model.

This folder belongs to the template: `copier update` keeps improving it.
"""
