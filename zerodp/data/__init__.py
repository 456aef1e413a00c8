"""Data: token batches as pure functions of (seed, step) (`batches`) and `zerodp prepare`'s tokenized
folders (`prepare`: tokenizing, the train/val split, meta.json).

Layer: above config and distributed; below the trainer. `prepare` needs no torch.
"""
