"""Files: checkpoints in Megatron-LM's layout (checkpoint.py: save, resume, convert between
layouts), Megatron-LM's torch and torch_dist formats, torch's .pt files without torch, Hugging
Face's GPT-2 weights. Skip on a first reading."""
