"""Checkpoints: save/load of DeepSpeed tags, the train state, the universal form, `app convert`."""
