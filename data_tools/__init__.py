"""Data tools: tokenizer training, pretokenization into Megatron .bin/.idx shards, inspection,
staging."""
